"""Optional dependencies: the core package imports without the extras, and a
feature that needs one names the extra to install.

Each check runs in a fresh interpreter where the extras' modules are made unimportable
(``sys.modules[name] = None`` makes ``import name`` raise ImportError), as in an install without them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXTRA_MODULES = ("reasoning_gym", "matplotlib", "hydra", "omegaconf", "gguf", "accelerate", "ray")


def run_without_extras(code: str, *args: str) -> subprocess.CompletedProcess:
    prelude = "import sys\nfor _m in %r:\n    sys.modules[_m] = None\n" % (EXTRA_MODULES,)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def test_core_dependencies_leave_out_the_extras():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for pip_name in ("matplotlib", "hydra-core", "reasoning-gym", "gguf", "accelerate"):
        assert pip_name not in core
    extras = project["optional-dependencies"]
    assert "matplotlib" in extras["study"] and any(d.startswith("reasoning-gym") for d in extras["study"])
    assert any(d.startswith("hydra-core") for d in extras["polygraph"])
    assert "gguf" in extras["embedded"]
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert any(d.startswith("ray") for d in extras["ray"]) and "ray" not in core
    for extra in ("study", "polygraph", "embedded", "ray"):
        assert extra in setup.split('pip_q -e ".[')[1].split(']"')[0].split(",")


#: Each feature that needs an extra: the code that reaches it, the pip package and the extra named.
MISSING_EXTRA_CASES = [
    ("from uhead_vllm import tasks; tasks.load_questions('basic_arithmetic', 3)", "reasoning-gym", "study"),
    ("from uhead_vllm import tasks; q = tasks.Question('basic_arithmetic', 'q', 'Calculate 1 + 1.', '2', {});"
     " tasks.grade(q, 'Answer: 2')", "reasoning-gym", "study"),
    ("from uhead_vllm.metrics import plot_calibration; plot_calibration('/tmp/_never.png', [0, 1], [0.2, 0.7])",
     "matplotlib", "study"),
    ("from pathlib import Path; from uhead_vllm import models;"
     " models._convert_gguf(Path('/nonexistent/m.gguf'), Path('/tmp/_never'))", "gguf", "embedded"),
    ("from uhead_vllm.scaleout import RayOptions, run_units; run_units(object, {}, [0], RayOptions())",
     "ray", "ray"),
]


@pytest.fixture(scope="module")
def without_extras() -> dict:
    """One fresh interpreter without the extras (each start imports torch and vLLM: ~15 s): first
    the public API, then every case of :data:`MISSING_EXTRA_CASES` in turn, each outcome reported."""
    proc = run_without_extras("""
        import json, uhead_vllm
        names = list(uhead_vllm.__all__)
        for n in names:
            getattr(uhead_vllm, n)
        import uhead_vllm.tasks, uhead_vllm.metrics, uhead_vllm.models, uhead_vllm.heads, uhead_vllm.features
        report = {"n": len(names), "loaded": [m for m in %r if sys.modules.get(m) is not None], "cases": []}
        for code in json.loads(sys.argv[1]):
            try:
                exec(code, {})
            except uhead_vllm.MissingExtraError as e:
                ok = isinstance(e, (uhead_vllm.UheadError, ImportError)) and e.exit_code == 2
                report["cases"].append({"message": str(e), "ok": ok})
            except Exception as e:
                report["cases"].append({"message": f"{type(e).__name__}: {e}", "ok": False})
            else:
                report["cases"].append({"message": "no MissingExtraError", "ok": False})
        print(json.dumps(report))
    """ % (EXTRA_MODULES,), json.dumps([code for code, _, _ in MISSING_EXTRA_CASES]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_public_api_imports_without_extras(without_extras):
    assert without_extras["n"] >= 10 and without_extras["loaded"] == []


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(MISSING_EXTRA_CASES)))
def test_missing_extra_names_the_extra(without_extras, case):
    _, package, extra = MISSING_EXTRA_CASES[case]
    got = without_extras["cases"][case]
    assert got["ok"], got["message"]
    assert f"'{package}'" in got["message"] and f"pip install 'uhead-vllm[{extra}]'" in got["message"]


@pytest.mark.slow
def test_cli_reports_missing_extra_in_one_line(tmp_path):
    proc = run_without_extras("""
        from uhead_vllm.cli import main
        raise SystemExit(main(["prepare-model", "--model-cache", sys.argv[1]]))
    """, str(tmp_path / "cache"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert "Traceback" not in proc.stderr and len(errors) == 1
    assert errors[0].startswith("uhead-vllm prepare-model: error:") and "pip install 'uhead-vllm[embedded]'" in errors[0]
