"""What stamps a results file: the commit that made it, and the GPU it ran on."""

from __future__ import annotations

import os
import subprocess
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
