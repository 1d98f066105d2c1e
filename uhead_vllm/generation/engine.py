"""Building a capturing ``vllm.LLM``: one builder for every backend (see :mod:`.backends`)."""

from __future__ import annotations

import gc
from typing import Any, Iterable

from ..adapters.versions import check_vllm_version
from .backends import get_backend


def build_llm(model: str, layers: Iterable[int], *, dtype: str = "float32",
              capture_dtype: str = "float32", max_capture_bytes: int = 4 << 30,
              backend: str = "aux", capture_dir: str | None = None, **llm_kwargs: Any):
    """``vllm.LLM`` for ``model`` with capture of ``layers`` installed (prefix caching stays on).

    ``backend`` names an entry of :data:`uhead_vllm.generation.backends.BACKENDS`: ``"aux"``
    (default; worker extension, exact with CUDA graphs) or ``"extract"`` (vLLM's
    ``extract_hidden_states`` writing files to ``capture_dir``; CPU only). See docs/backends.md.

    Unreachable engines are collected first: an in-process engine that is dropped but still in a
    reference cycle shuts down whenever the garbage collector gets to it, and its shutdown tears
    down vLLM's process-wide parallel state; if that happened while this engine is being built,
    it would fail with "pipeline model parallel group is not initialized".
    """
    from vllm import LLM

    check_vllm_version()
    kwargs = get_backend(backend).engine_kwargs(layers, capture_dtype=capture_dtype,
                                                max_capture_bytes=max_capture_bytes, capture_dir=capture_dir)
    extra = llm_kwargs.pop("additional_config", None) or {}
    if extra:
        kwargs["additional_config"] = {**kwargs.get("additional_config", {}), **extra}
    gc.collect()
    return LLM(model=model, dtype=dtype, **kwargs, **llm_kwargs)
