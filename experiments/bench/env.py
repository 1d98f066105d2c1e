"""Process environment for benchmark runs; must be applied before vLLM is first imported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_ROOT = REPO_ROOT / ".cache"


def setup_env() -> None:
    """In-process engine (several engines run one after another in this process), quiet logs,
    project-local compile caches shared with the tests, and no hub access."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from uhead_vllm.runtime import set_env_defaults

    set_env_defaults()


def in_process_engine() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
