"""Engine-side handle on the worker capture: how to build a capturing ``LLM`` and fetch rows."""

from __future__ import annotations

import gc
import json
from typing import Any, Iterable

from ..adapters import engine as engine_internals
from ..adapters.versions import check_vllm_version
from ..capture.protocol import (
    CAPTURE_KEY,
    EXTENSION_QUALNAME,
    CapturedRows,
    CaptureSettings,
    decode_rows,
)


class CaptureNotInstalledError(RuntimeError):
    """The vLLM engine was built without the uhead_vllm worker extension."""


def capture_engine_kwargs(
    layers: Iterable[int], dtype: str = "float32", max_bytes: int = 4 << 30
) -> dict[str, Any]:
    """Keyword arguments to merge into ``vllm.LLM(...)`` so its workers capture ``layers``.

    Layers are fixed at engine construction because compiled mode bakes them into the graph.
    Raises ``UnsupportedVllmError`` for a vLLM outside the checked versions.
    """
    check_vllm_version()
    settings = CaptureSettings(layers=tuple(int(k) for k in layers), dtype=dtype, max_bytes=max_bytes)
    return {
        "worker_extension_cls": EXTENSION_QUALNAME,
        "additional_config": {CAPTURE_KEY: settings.to_dict()},
    }


def build_llm(model: str, layers: Iterable[int], *, dtype: str = "float32",
              capture_dtype: str = "float32", max_capture_bytes: int = 4 << 30,
              backend: str = "aux", capture_dir: str | None = None, **llm_kwargs: Any):
    """``vllm.LLM`` for ``model`` with capture of ``layers`` installed (prefix caching stays on).

    ``backend="aux"``: worker extension + aux hidden states (``capture_engine_kwargs``);
    ``backend="extract"``: vLLM's ``extract_hidden_states`` method writing files to
    ``capture_dir`` (``extract_backend.extract_engine_kwargs``). See docs/backends.md.

    Unreachable engines are collected first: an in-process engine that is dropped but still in a
    reference cycle shuts down whenever the garbage collector gets to it, and its shutdown tears
    down vLLM's process-wide parallel state; if that happened while this engine is being built,
    it would fail with "pipeline model parallel group is not initialized".
    """
    from vllm import LLM

    check_vllm_version()
    gc.collect()
    if backend == "extract":
        from .extract_backend import extract_engine_kwargs

        if engine_internals.platform_is_cuda():
            raise NotImplementedError(
                "the 'extract' backend is not supported on GPU: vLLM 0.26's Model Runner V2 refuses "
                "extract_hidden_states, and on the V1 runner the prefix cache could not be reset "
                "after generation (the connector still held requests), so multi-step use breaks and "
                "parity was never shown (experiments/results/gpu/parity-v1-graphs-extract.log). Use "
                "backend='aux': exact with CUDA graphs on both runners")

        return LLM(model=model, dtype=dtype, **extract_engine_kwargs(layers, capture_dir, capture_dtype),
                   **llm_kwargs)
    if backend != "aux":
        raise ValueError(f"backend must be 'aux' or 'extract', got {backend!r}")
    kwargs = capture_engine_kwargs(layers, capture_dtype, max_capture_bytes)
    extra = llm_kwargs.pop("additional_config", None) or {}
    kwargs["additional_config"].update(extra)
    return LLM(model=model, dtype=dtype, **kwargs, **llm_kwargs)


def open_capture_client(llm: Any) -> Any:
    """The capture client matching how ``llm`` was built (extract connector, else aux extension)."""
    from .extract_backend import ExtractClient, is_extract_engine

    return ExtractClient(llm) if is_extract_engine(llm) else CaptureClient(llm)


class CaptureClient:
    """Talks to the capture extension through ``collective_rpc``; payloads are safetensors bytes."""

    def __init__(self, llm: Any):
        self.llm = llm
        self.settings = self._read_settings()

    def _read_settings(self) -> CaptureSettings:
        try:
            statuses = self.llm.collective_rpc("uhead_status")
        except Exception as exc:  # vLLM raises AttributeError/RuntimeError variants
            raise CaptureNotInstalledError(
                "this vLLM engine has no uhead_vllm capture extension; build it with "
                "uhead_vllm.build_llm(...) or pass **uhead_vllm.capture_engine_kwargs(layers) to "
                f"vllm.LLM ({exc})"
            ) from exc
        recording = [json.loads(s) for s in statuses if json.loads(s).get("recording")]
        if len(recording) != 1:
            raise CaptureNotInstalledError(
                f"expected exactly one recording worker rank, found {len(recording)}: pass "
                "capture_engine_kwargs(layers) (additional_config) when building vllm.LLM"
            )
        return CaptureSettings.from_dict(recording[0]["settings"])

    def fetch(self) -> CapturedRows:
        """Rows recorded since the previous fetch (the worker forgets them). With the engine core
        in this process the rows are handed over as objects; across processes as safetensors."""
        inline = engine_internals.worker_in_process(self.llm)
        payloads = [p for p in self.llm.collective_rpc("uhead_fetch", args=(inline,)) if p is not None]
        if len(payloads) != 1:
            raise RuntimeError(f"expected one capture payload, got {len(payloads)}")
        if not inline:
            return decode_rows(payloads[0])
        if not isinstance(payloads[0], CapturedRows):
            raise TypeError(f"in-process capture fetch returned {type(payloads[0]).__name__}")
        return payloads[0]
