"""What stamps a results file: the commit that made it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """``UHEAD_COMMIT`` when set (the GPU machine gets a working tree, not the repository), else the
    checkout's short commit, else ``"unknown"``."""
    env = os.environ.get("UHEAD_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
