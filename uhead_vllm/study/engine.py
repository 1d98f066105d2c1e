"""Building the capturing engine for the study and the main job, with quiet offline defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def set_env_defaults() -> None:
    """Project CPU defaults (see :mod:`uhead_vllm.runtime`) with vLLM's logging at errors only."""
    from ..runtime import set_env_defaults as _set

    _set(VLLM_LOGGING_LEVEL="ERROR")


def set_threads(num_threads: int | None) -> None:
    """Torch intra-op threads for head training/scoring (1 is fastest on a busy 2-core box)."""
    if num_threads is not None and num_threads > 0:
        import torch

        torch.set_num_threads(int(num_threads))


def engine_kwargs(max_num_seqs: int = 64, max_model_len: int = 1024, kv_cache_bytes: int = 256 << 20) -> dict[str, Any]:
    """vLLM settings for a 135M model on CPU: fp32 compute (no AVX512-bf16 here), eager mode
    (3 s load instead of 30-45 s), 32-token blocks so the shared instruction prefix is cached."""
    return dict(
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        seed=0,
        enable_prefix_caching=True,
    )


def build_generator(model_path: str | Path, layers: Sequence[int], *, capture_dtype: str = "bfloat16",
                    store_max_bytes: int = 256 << 20, **overrides: Any) -> Any:
    """A :class:`VllmHiddenStatesGenerator` over a fresh engine capturing ``layers``."""
    set_env_defaults()
    from ..generation import VllmHiddenStatesGenerator, build_llm

    kwargs = engine_kwargs()
    kwargs.update(overrides)
    llm = build_llm(str(model_path), list(layers), capture_dtype=capture_dtype, **kwargs)
    return VllmHiddenStatesGenerator(llm, store_max_bytes=store_max_bytes, step_cache_max_idle=1)
