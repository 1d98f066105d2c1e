"""Engine side of the ``extract`` capture backend: vLLM's native ``extract_hidden_states`` method.

vLLM itself takes the aux hidden states where its model runner receives them, stores them in a
dedicated KV-cache group and, through :class:`~uhead_vllm.capture.extract_connector.
UheadHiddenStatesConnector`, writes one safetensors file per finished tagged request. This module
builds the engine kwargs and turns those files into the same :class:`CapturedRows` the ``aux``
backend returns, so :class:`VllmHiddenStatesGenerator` assembles both the same way.

Because the hidden states live in KV blocks, prefix-cache hits come with their rows (the block of
the earlier request is shared), so no gap filling is needed; only the last sampled token, which
vLLM never forwards, is missing and is recomputed on request.
"""

from __future__ import annotations

import os
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from safetensors import safe_open

from ...capture.extract_connector import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    DATA_SUFFIX,
    ERROR_SUFFIX,
    FILE_PREFIX,
    PENDING_SUFFIX,
    parse_stem,
)
from ...adapters import engine as engine_internals
from ...capture.protocol import CapturedRows, CaptureSettings, empty_rows
from .base import Placement, live_engine

#: Keys of ``kv_connector_extra_config`` read back by :class:`ExtractClient`.
LAYERS_KEY = "uhead_layers"
DTYPE_KEY = "uhead_dtype"


def extract_engine_kwargs(layers: Iterable[int], out_dir: str | os.PathLike | None = None,
                          dtype: str = "float32") -> dict[str, Any]:
    """``vllm.LLM`` kwargs for capture through ``extract_hidden_states`` into ``out_dir``.

    ``layers`` use HF indexing (vLLM's aux layer id k is HF ``hidden_states[k]``: 0 = embeddings,
    the last is before the final norm). vLLM emits them in ascending order; the requested order is
    kept in the connector config and restored on read. ``out_dir`` defaults to a fresh temporary
    directory; give each engine its own, the client deletes every result file it reads there.
    """
    settings = CaptureSettings(layers=tuple(int(k) for k in layers), dtype=dtype)
    path = str(out_dir) if out_dir is not None else tempfile.mkdtemp(prefix="uhead-extract-")
    os.makedirs(path, exist_ok=True)
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": sorted(settings.layers)}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": path,
                LAYERS_KEY: list(settings.layers),
                DTYPE_KEY: settings.dtype,
            },
        },
    }


def _connector_extra(llm: Any) -> dict | None:
    connector = engine_internals.kv_connector(llm)
    return connector[1] if connector is not None and connector[0] == CONNECTOR_NAME else None


def is_extract_engine(llm: Any) -> bool:
    """True when ``llm`` was built with :func:`extract_engine_kwargs`."""
    return _connector_extra(llm) is not None


def read_results(out_dir: str | os.PathLike, layers: tuple[int, ...], dtype: torch.dtype,
                 hidden_size: int, delete: bool = True) -> CapturedRows:
    """All result files in ``out_dir`` as one :class:`CapturedRows` (files removed unless told).

    Each file holds positions ``0..T-1`` of one request in ascending aux-layer order; rows are
    reordered to ``layers``. ``.error`` files become ``CapturedRows.error``. safetensors parsing
    never executes code.
    """
    out = Path(out_dir)
    aux = tuple(sorted(layers))
    select = [aux.index(k) for k in layers]
    errors, chunks = [], []
    for f in sorted(out.glob(f"{FILE_PREFIX}*{ERROR_SUFFIX}")):
        errors.append(f"{f.stem}: {f.read_text()}")
        if delete:
            f.unlink()
    for f in sorted(out.glob(f"{FILE_PREFIX}*{DATA_SUFFIX}")):
        tag = parse_stem(f.name[: -len(DATA_SUFFIX)])
        with safe_open(str(f), framework="pt") as st:
            hidden = st.get_tensor("hidden_states")
            token_ids = st.get_tensor("token_ids").to(torch.int64)
        if delete:
            f.unlink()
        if hidden.dim() != 3 or hidden.shape[1] != len(aux) or hidden.shape[0] != token_ids.numel():
            errors.append(f"{f.name}: hidden_states {tuple(hidden.shape)} does not match "
                          f"{token_ids.numel()} token ids x {len(aux)} layers")
            continue
        if hidden.shape[0]:
            chunks.append((tag, token_ids, hidden[:, select].to(dtype)))
    if not chunks:
        rows = empty_rows(tuple(layers), hidden_size, dtype)
    else:
        lens = torch.tensor([c[1].numel() for c in chunks], dtype=torch.int64)
        rows = CapturedRows(
            layers=tuple(layers),
            hidden_parts=[c[2] for c in chunks],
            tags=torch.repeat_interleave(torch.tensor([c[0].tag for c in chunks]), lens),
            samples=torch.repeat_interleave(torch.tensor([c[0].sample for c in chunks]), lens),
            positions=torch.cat([torch.arange(c[1].numel(), dtype=torch.int64) for c in chunks]),
            token_ids=torch.cat([c[1] for c in chunks]),
            chunk_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
        )
    rows.error = "; ".join(errors) or None
    rows.stats = {"files": len(chunks)}
    return rows


class ExtractClient:
    """Same contract as :class:`~uhead_vllm.generation.engine.CaptureClient` for the extract backend.

    ``fetch`` waits until every tagged request has its file (the worker writes a request's rows one
    engine step after it finishes), then reads and deletes the files.
    """

    def __init__(self, llm: Any, timeout: float = 120.0):
        extra = _connector_extra(llm)
        if extra is None or LAYERS_KEY not in extra:
            raise ValueError("this vLLM engine was not built with extract_engine_kwargs(...)")
        self._llm = weakref.ref(llm)  # the per-engine client cache must never keep an engine alive
        self.timeout = timeout
        self.out_dir = Path(extra["shared_storage_path"])
        self.settings = CaptureSettings(layers=tuple(int(k) for k in extra[LAYERS_KEY]),
                                        dtype=extra.get(DTYPE_KEY, "float32"))
        self.hidden_size = engine_internals.hidden_size(llm)

    @property
    def llm(self) -> Any:
        return live_engine(self._llm)

    def _wait(self) -> None:
        deadline = time.monotonic() + self.timeout
        in_process = engine_internals.engine_core_in_process(self.llm)
        while list(self.out_dir.glob(f"{FILE_PREFIX}*{PENDING_SUFFIX}")):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"hidden-state files in {self.out_dir} still pending after {self.timeout} s; "
                    "is another caller running requests on this engine?")
            if in_process:
                engine_internals.step_engine(self.llm)  # lets the worker write finished requests
            else:
                time.sleep(0.005)

    def place_into(self, slots: dict, shape: tuple, groups: Sequence = (), starts: dict | None = None) -> Placement:
        """Rows of this backend arrive as files after the generation: never placed while it runs;
        earlier rows are dropped."""
        self.fetch()
        return Placement(None)

    def fetch(self) -> CapturedRows:
        """Rows of every request finished since the previous fetch (their files are deleted)."""
        return self._read()

    def fetch_later(self) -> Callable[[], CapturedRows]:
        """The files are read when asked for (nothing to send ahead)."""
        return self._read

    def _read(self) -> CapturedRows:
        self._wait()
        return read_results(self.out_dir, self.settings.layers, self.settings.torch_dtype,
                            self.hidden_size)


class ExtractBackend:
    name = "extract"

    def engine_kwargs(self, layers: Iterable[int], *, capture_dtype: str = "float32",
                      max_capture_bytes: int = 4 << 30, capture_dir: str | None = None,
                      points: Iterable[Any] = (), steering: bool = False, token_inputs: str = "") -> dict[str, Any]:
        if list(points) or steering or token_inputs:
            raise ValueError("capture points, steering and token inputs are features of the 'aux' backend (worker hooks); "
                             "the 'extract' backend reads vLLM's residual-stream outputs only")
        if engine_internals.platform_is_cuda():
            raise NotImplementedError(
                "the 'extract' backend is not supported on GPU: vLLM 0.26's Model Runner V2 refuses "
                "extract_hidden_states, and on the V1 runner the prefix cache could not be reset "
                "after generation (the connector still held requests), so multi-step use breaks and "
                "parity was never shown (experiments/results/gpu/parity-v1-graphs-extract.log). Use "
                "backend='aux': exact with CUDA graphs on both runners")
        return extract_engine_kwargs(layers, capture_dir, capture_dtype)

    def owns(self, llm: Any) -> bool:
        return is_extract_engine(llm)

    def open_client(self, llm: Any) -> ExtractClient:
        return ExtractClient(llm)


EXTRACT = ExtractBackend()

__all__ = ["EXTRACT", "ExtractBackend", "ExtractClient", "extract_engine_kwargs", "is_extract_engine",
           "read_results"]
