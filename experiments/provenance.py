"""What stamps a results file: the commit that made it, the command and the machine it ran on."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def commit() -> str:
    """``UHEAD_COMMIT`` when set (the GPU machine gets a working tree, not the repository), else the
    checkout's short commit with ``+dirty`` when tracked files outside ``experiments/results``
    differ from it (the results were not made by that commit alone), else ``"unknown"``."""
    env = os.environ.get("UHEAD_COMMIT")
    if env:
        return env
    try:
        sha = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!experiments/results")
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def gpu_name() -> str:
    """The first GPU's name from ``nvidia-smi`` (no CUDA context in this process: vLLM would start
    its engine processes by spawn after one), or what stood in the way."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "none (no nvidia-smi)"
    return out.splitlines()[0] if out else "none (no GPU listed)"


def stamp(module: str, argv: list[str] | None, cuda: bool = False) -> dict[str, str]:
    """A results file's commit, command (``python -m module`` with ``argv``, else this process's
    arguments) and hardware (the GPU's name on a CUDA run, else the CPU's)."""
    return {"commit": commit(),
            "command": shlex.join(["python", "-m", module, *(argv if argv is not None else sys.argv[1:])]),
            "hardware": gpu_name() if cuda else platform.processor() or platform.machine()}


def write(out: Path, name: str, result: dict, lines: list[str]) -> None:
    """``result`` as ``out/name.json`` and the report ``lines`` as ``out/name.md`` (and printed)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
