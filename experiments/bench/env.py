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
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(CACHE_ROOT / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(CACHE_ROOT / "inductor"),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def in_process_engine() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
