"""The default backend: the uhead_vllm worker extension records aux hidden states at the
model-runner level (``uhead_vllm.capture``); rows come back through ``collective_rpc``."""

from __future__ import annotations

import functools
import json
import threading
import weakref
from typing import Any, Callable, Iterable

import torch

from ...adapters import engine as engine_internals
from ...adapters.versions import check_vllm_version
from ...capture.protocol import (
    CAPTURE_KEY,
    EXTENSION_QUALNAME,
    UNWRITTEN,
    CapturedRows,
    CaptureSettings,
    RowDestination,
    SharedDestination,
    decode_rows,
    destination_nbytes,
)
from ... import envs
from ...errors import CaptureNotInstalledError
from ..host_memory import host_buffer
from ..shared_rows import SharedRowFiles
from .base import Placement, raise_if_engine_dead


def capture_engine_kwargs(
    layers: Iterable[int], dtype: str = "float32", max_bytes: int = 4 << 30, *,
    points: Iterable[Any] = (), steering: bool = False,
) -> dict[str, Any]:
    """Keyword arguments to merge into ``vllm.LLM(...)`` so its workers capture ``layers``.

    Layers are fixed at engine construction because compiled mode bakes them into the graph.
    ``points``: extra ``(point, decoder layer)`` sites (``attn_in``, ``attn_out``, ``mlp_in``,
    ``mlp_out``; see ``uhead_vllm.capture.points``), captured as columns after the layers.
    ``steering=True`` lets requests steer (``SamplingParams.extra_args["uhead_steer"]``). Both are
    hooks, so the engine must be eager (a compiled one is refused when it loads).
    Raises ``UnsupportedVllmError`` for a vLLM outside the checked versions, ``ValueError`` for
    an unknown point.
    """
    check_vllm_version()
    settings = CaptureSettings(layers=tuple(int(k) for k in layers), dtype=dtype, max_bytes=max_bytes,
                               points=tuple(points), steering=bool(steering))
    return {
        "worker_extension_cls": EXTENSION_QUALNAME,
        "additional_config": {CAPTURE_KEY: settings.to_dict()},
    }


#: Every engine's shared row files (:class:`SharedRowFiles`), shared by the generators on it.
_ROW_FILES: "weakref.WeakKeyDictionary[Any, SharedRowFiles]" = weakref.WeakKeyDictionary()
_ROW_FILES_GUARD = threading.Lock()
def shared_row_files(llm: Any) -> SharedRowFiles:
    """The shared row files of ``llm``: one set per engine, so that the worker's mappings of the
    files (kept under their keys) serve every generator on it."""
    with _ROW_FILES_GUARD:
        files = _ROW_FILES.get(llm)
        if files is None:
            files = _ROW_FILES[llm] = SharedRowFiles()
        return files


class AuxClient:
    """Talks to the capture extension through ``collective_rpc``."""

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

    def place_into(self, slots: dict[int, tuple[int, int]], shape: tuple[int, int, int],
                   groups: list[tuple[int, tuple[int, ...]]] = ()) -> Placement:
        """Drop rows recorded before (with the hand-over) and give the worker a buffer of ``shape``
        to write the next generation's rows into while it runs (``slots``: request tag -> first
        row, capacity; ``groups``: see :class:`RowDestination`). In this process a plain tensor;
        with the engine core in another process a shared-memory file both sides map, handed over
        without waiting for the worker's reply (see :class:`Placement`). No destination where
        neither can be had (the rows then come back with ``fetch``)."""
        dtype = self.settings.dtype
        if engine_internals.worker_in_process(self.llm):
            destination = RowDestination(host_buffer(shape, self.settings.torch_dtype), slots, list(groups))
            placed = any(self.llm.collective_rpc("uhead_place_into", args=(destination,)))
            return Placement(destination if placed else None)
        files = shared_row_files(self.llm)
        taken = files.take(destination_nbytes(shape, dtype))
        if taken is None:  # no room in shared memory: the rows come back with the fetch
            self.fetch()
            return Placement(None)
        row_file, flat = taken
        spec = SharedDestination(row_file.path, shape, dtype, slots, row_file.file_id, list(groups),
                                 row_file.key, row_file.nbytes, tuple(files.keys()), envs.file_writes())
        with torch.inference_mode(False):  # the row store relies on the buffer's version counter
            destination = spec.on(flat, tables=False)
        destination.marks.fill(UNWRITTEN)  # a file handed out again holds an earlier call's marks
        # Both sides hold their mappings once the worker answered: the memory goes with the last one.
        unname = functools.partial(files.unname, row_file)
        payload = spec.to_json()
        sent = engine_internals.send_collective_rpc(self.llm, "uhead_place_into", (payload,))
        ask = sent or functools.partial(self.llm.collective_rpc, "uhead_place_into", args=(payload,))
        placement = Placement(destination, lambda: any(ask()), unname)
        if sent is None or envs.settle_placement():
            placement.settle()  # ask now, before the requests are sent (see SETTLE_PLACEMENT_ENV)
        return placement

    def fetch(self) -> CapturedRows:
        """Rows recorded since the previous fetch (the worker forgets them). With the engine core
        in this process the rows are handed over as objects; across processes as safetensors."""
        return self._fetch_now(engine_internals.worker_in_process(self.llm))

    def fetch_later(self) -> Callable[[], CapturedRows]:
        """Ask for the rows now and return what waits for them: with the engine core in another
        process the caller does its work that needs no rows during the round trip (the worker
        first waits for its last rows to be placed)."""
        inline = engine_internals.worker_in_process(self.llm)
        sent = None if inline else engine_internals.send_collective_rpc(self.llm, "uhead_fetch", (False,))
        if sent is None:
            rows = self._fetch_now(inline)
            return lambda: rows
        return lambda: self._one(sent(), False)

    def _fetch_now(self, inline: bool) -> CapturedRows:
        return self._one(self.llm.collective_rpc("uhead_fetch", args=(inline,)), inline)

    @staticmethod
    def _one(payloads: list, inline: bool) -> CapturedRows:
        """The recording rank's rows from every rank's answer (objects in process, else safetensors)."""
        payloads = [p for p in payloads if p is not None]
        if len(payloads) != 1:
            raise RuntimeError(f"expected one capture payload, got {len(payloads)}")
        if not inline:
            return decode_rows(payloads[0])
        if not isinstance(payloads[0], CapturedRows):
            raise TypeError(f"in-process capture fetch returned {type(payloads[0]).__name__}")
        return payloads[0]


class AuxBackend:
    name = "aux"

    def engine_kwargs(self, layers: Iterable[int], *, capture_dtype: str = "float32",
                      max_capture_bytes: int = 4 << 30, capture_dir: str | None = None,
                      points: Iterable[Any] = (), steering: bool = False) -> dict[str, Any]:
        if capture_dir is not None:
            raise ValueError("capture_dir is for the 'extract' backend; the 'aux' backend keeps rows in memory")
        return capture_engine_kwargs(layers, capture_dtype, max_capture_bytes, points=points, steering=steering)

    def owns(self, llm: Any) -> bool:
        return CAPTURE_KEY in engine_internals.additional_config(llm)

    def open_client(self, llm: Any) -> AuxClient:
        return AuxClient(llm)


AUX = AuxBackend()
