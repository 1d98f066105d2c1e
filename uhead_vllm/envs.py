"""Every environment variable uhead_vllm reads, in one typed module (as ``vllm/envs.py``).

Each variable has a name constant (for tests and launchers that set it) and a function that reads
it now, not at import, so a process can change it between calls. Nothing else in the package
reads ``os.environ`` for its own settings. This module imports nothing from the package, so the
worker side (``uhead_vllm.capture``) reads it too.

| variable | read where | meaning |
|---|---|---|
| ``UHEAD_VLLM_HEAD_DIR`` | caller | the directory every "default head" lookup uses |
| ``UHEAD_VLLM_MODEL_CACHE`` | caller | where converted models live (default: ``$XDG_CACHE_HOME/uhead_vllm/models``) |
| ``UHEAD_VLLM_ALLOW_OTHER_WEIGHTS`` | caller | ``1``: load a head trained on other weights of the same shapes |
| ``UHEAD_VLLM_ALLOW_UNSUPPORTED_VLLM`` | caller, engine | ``1``: run on a vLLM outside the checked versions |
| ``UHEAD_FILE_WRITES`` | caller, else engine | ``1``: the device writes row files; ``0``: the host placer |
| ``UHEAD_PLACE_AT_DRAIN`` | engine | measuring aid: ``1`` places rows at the fetch, not beside the engine |
| ``UHEAD_STEP_GRAPHS`` | engine | ``0``: step copies stay eager on a GPU (no CUDA graphs) |
| ``UHEAD_STEP_BATCH`` | engine | measuring aid: ``STEPS,ROWS`` per recorded batch |
| ``UHEAD_SETTLE_PLACEMENT`` | caller | measuring aid: ``1`` waits for the worker's destination first |
"""

from __future__ import annotations

import os
from pathlib import Path

HEAD_DIR_ENV = "UHEAD_VLLM_HEAD_DIR"
MODEL_CACHE_ENV = "UHEAD_VLLM_MODEL_CACHE"
ALLOW_OTHER_WEIGHTS_ENV = "UHEAD_VLLM_ALLOW_OTHER_WEIGHTS"
ALLOW_UNSUPPORTED_ENV = "UHEAD_VLLM_ALLOW_UNSUPPORTED_VLLM"
FILE_WRITES_ENV = "UHEAD_FILE_WRITES"
PLACE_AT_DRAIN_ENV = "UHEAD_PLACE_AT_DRAIN"
STEP_GRAPHS_ENV = "UHEAD_STEP_GRAPHS"
STEP_BATCH_ENV = "UHEAD_STEP_BATCH"
SETTLE_PLACEMENT_ENV = "UHEAD_SETTLE_PLACEMENT"


def _path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def _flag(name: str) -> bool:
    """``1`` is on; unset, empty or ``0`` is off; anything else is refused (a typo is not "off")."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: expected 1 or 0")
    return value == "1"


def head_dir() -> Path | None:
    """:data:`HEAD_DIR_ENV`, or None to use the head shipped in ``uhead_vllm/heads/default``."""
    return _path(HEAD_DIR_ENV)


def model_cache_dir() -> Path:
    """:data:`MODEL_CACHE_ENV`, else ``$XDG_CACHE_HOME/uhead_vllm/models`` (``~/.cache`` without it)."""
    return _path(MODEL_CACHE_ENV) or (_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "uhead_vllm" / "models"


def allow_other_weights() -> bool:
    """:data:`ALLOW_OTHER_WEIGHTS_ENV`: any value but empty or ``0`` accepts a head of other weights."""
    return os.environ.get(ALLOW_OTHER_WEIGHTS_ENV, "") not in ("", "0")


def allow_unsupported_vllm() -> bool:
    return os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1"


def file_writes() -> bool | None:
    """:data:`FILE_WRITES_ENV`: True for ``1``, False for ``0``, None when unset (the device writes
    where its kernels run, else the placer). Read in the caller's process at every generation (it
    travels with the destination), else in the engine's."""
    value = os.environ.get(FILE_WRITES_ENV)
    if value not in (None, "", "0", "1"):
        raise ValueError(f"{FILE_WRITES_ENV}={value!r}: expected 1 (the device writes rows) or 0 (the host placer)")
    return None if not value else value == "1"


def place_at_drain() -> bool:
    return os.environ.get(PLACE_AT_DRAIN_ENV) == "1"


def step_graphs() -> bool:
    """:data:`STEP_GRAPHS_ENV`: True (the default) unless set to ``0``."""
    return os.environ.get(STEP_GRAPHS_ENV, "1") != "0"


def step_batch() -> tuple[int, int] | None:
    """:data:`STEP_BATCH_ENV` as ``(steps, rows)``, both ≥ 1, or None when unset."""
    given = os.environ.get(STEP_BATCH_ENV)
    if not given:
        return None
    try:
        steps, rows = (int(x) for x in given.split(","))
    except ValueError:
        steps = rows = 0
    if steps < 1 or rows < 1:
        raise ValueError(f"{STEP_BATCH_ENV}={given!r}: expected STEPS,ROWS (two positive integers)")
    return steps, rows


def settle_placement() -> bool:
    return os.environ.get(SETTLE_PLACEMENT_ENV) == "1"
