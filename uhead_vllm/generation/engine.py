"""Engine-side handle on the worker capture: how to build a capturing ``LLM`` and fetch rows."""

from __future__ import annotations

import gc
import json
from typing import Any, Iterable

from ..errors import EngineDeadError, InputError
from ..capture.protocol import (
    CAPTURE_KEY,
    EXTENSION_QUALNAME,
    CapturedRows,
    CaptureSettings,
    decode_rows,
)


class CaptureNotInstalledError(InputError, RuntimeError):
    """The vLLM engine was built without the uhead_vllm worker extension."""


def raise_if_engine_dead(exc: BaseException) -> None:
    """Re-raise vLLM's "engine dead" as :class:`uhead_vllm.errors.EngineDeadError`, so a crashed
    engine is reported as one (and not as a missing capture extension or a capture bug)."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
    except ImportError:  # another vLLM layout: nothing to translate
        return
    if isinstance(exc, VllmEngineDeadError):
        raise EngineDeadError(
            "the vLLM engine is dead (its engine core failed earlier; the first error is in the log "
            "above); build a new engine"
        ) from exc


def capture_engine_kwargs(
    layers: Iterable[int], dtype: str = "float32", max_bytes: int = 4 << 30
) -> dict[str, Any]:
    """Keyword arguments to merge into ``vllm.LLM(...)`` so its workers capture ``layers``.

    Layers are fixed at engine construction because compiled mode bakes them into the graph.
    """
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

    gc.collect()
    if backend == "extract":
        from .extract_backend import extract_engine_kwargs

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
            raise_if_engine_dead(exc)
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
        """Rows recorded since the previous fetch (the worker forgets them)."""
        payloads = [p for p in self.llm.collective_rpc("uhead_fetch") if p is not None]
        if len(payloads) != 1:
            raise RuntimeError(f"expected one capture payload, got {len(payloads)}")
        return decode_rows(payloads[0])
