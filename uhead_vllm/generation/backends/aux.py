"""The default backend: the uhead_vllm worker extension records aux hidden states at the
model-runner level (``uhead_vllm.capture``); rows come back through ``collective_rpc``
(``uhead_begin`` / ``uhead_take`` / ``uhead_status``), by the engine's transport (transports.py)."""

from __future__ import annotations

import json
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch

from ...adapters import engine as engine_internals
from ...adapters.versions import check_vllm_version
from ...capture.protocol import (CAPTURE_KEY, EXTENSION_QUALNAME, CapturedRows, CaptureSettings, SharedDestination,
                                 decode_rows)
from ...capture.row_files import destination_nbytes, destination_on
from ...capture.token_weight import load_weight
from ...errors import CaptureNotInstalledError
from .base import Placement, live_engine, raise_if_engine_dead
from ..shared_rows import RowFile, SharedRowFiles
from .transports import shared_row_files, transport_for


def capture_engine_kwargs(
    layers: Iterable[int], dtype: str = "float32", max_bytes: int = 4 << 30, *,
    points: Iterable[Any] = (), steering: bool = False, token_inputs: str = "",
) -> dict[str, Any]:
    """Keyword arguments to merge into ``vllm.LLM(...)`` so its workers capture ``layers``.

    Layers are fixed at engine construction because compiled mode bakes them into the graph.
    ``points``: extra ``(point, decoder layer)`` sites (``attn_in``, ``attn_out``, ``mlp_in``,
    ``mlp_out``; see ``uhead_vllm.capture.points``), captured as columns after the layers.
    ``steering=True`` lets requests steer (``SamplingParams.extra_args["uhead_steer"]``). Both are
    hooks, so the engine must be eager (a compiled one is refused when it loads).
    ``token_inputs``: a head's token-inputs file (``TokenInputs.save``) reading exactly ``layers``
    in their order: the worker then reduces each row to the head's ``D`` inputs on the device, and
    rows are ``[rows, 1, D]`` float32 (docs/capture.md#scores-without-rows).
    Raises ``UnsupportedVllmError`` for a vLLM outside the checked versions, ``ValueError`` for
    an unknown point or a token-inputs file that does not read ``layers``.
    """
    check_vllm_version()
    settings = CaptureSettings(layers=tuple(int(k) for k in layers), dtype=dtype, max_bytes=max_bytes,
                               points=tuple(points), steering=bool(steering), token_inputs=str(token_inputs or ""))
    if settings.token_inputs:
        read, _ = load_weight(settings.token_inputs)
        if read != settings.layers:
            raise ValueError(f"token_inputs {settings.token_inputs} reads layers {list(read)}; the engine would "
                             f"capture {list(settings.layers)}: pass exactly the head's layers, in its order")
    return {
        "worker_extension_cls": EXTENSION_QUALNAME,
        "additional_config": {CAPTURE_KEY: settings.to_dict()},
    }


class AuxClient:
    """Talks to the capture extension through ``collective_rpc`` (the sync face: ``vllm.LLM``).

    Its transport (:mod:`.transports`: in this process, or to an engine core in another) is
    chosen once, when the client is made; :func:`~uhead_vllm.generation.backends.make_capture_client`
    makes one per engine. The engine is held weakly, so a cached client never keeps it alive.
    """

    def __init__(self, llm: Any):
        self._llm = weakref.ref(llm)
        self.transport = transport_for(llm)
        self.settings = settings_of([json.loads(s) for s in self._status_payloads()])

    @property
    def llm(self) -> Any:
        return live_engine(self._llm)

    def _status_payloads(self) -> list[str]:
        try:
            return self.transport.call(self.llm, "uhead_status")
        except Exception as exc:  # vLLM raises AttributeError/RuntimeError variants
            raise_if_engine_dead(exc)
            raise CaptureNotInstalledError(
                "this vLLM engine has no uhead_vllm capture extension; build it with "
                "uhead_vllm.build_llm(...) or pass **uhead_vllm.capture_engine_kwargs(layers) to "
                f"vllm.LLM ({exc})"
            ) from exc

    def place_into(self, slots: dict[int, tuple[int, int]], shape: tuple[int, int, int],
                   groups: Sequence[tuple[int, tuple[int, ...]]] = (), starts: dict[int, int] | None = None) -> Placement:
        """Drop rows recorded before (the worker's ``uhead_begin``) and give the worker a buffer of
        ``shape`` to write the next generation's rows into while it runs (``slots``: request tag ->
        first row, capacity; ``groups``, ``starts``: see ``capture/destination.py``). In this process a plain
        tensor; with the engine core in another process a shared-memory file both sides map,
        handed over without waiting for the worker's reply (see :class:`Placement`). No
        destination where neither can be had (the rows then come back with ``fetch``)."""
        return self.transport.begin(self.llm, self.settings, slots, shape, list(groups), starts)

    def fetch(self) -> CapturedRows:
        """Rows recorded since the previous fetch (the worker forgets them). In this process they
        are handed over as objects; across processes as safetensors."""
        return self._one(self.transport.call(self.llm, "uhead_take", None, False, self.transport.inline))

    def fetch_later(self) -> Callable[[], CapturedRows]:
        """Ask for the rows now and return what waits for them: with the engine core in another
        process the caller does its work that needs no rows during the round trip (the worker
        first waits for its last rows to be placed)."""
        sent = self.transport.send(self.llm, "uhead_take", None, False, self.transport.inline)
        return lambda: self._one(sent())

    def take_tags(self, tags: list[int], forget: bool = False) -> CapturedRows:
        """Only the rows of ``tags`` (the rows of other requests stay in the worker); ``forget``
        also stops recording them."""
        return self._one(self.transport.call(self.llm, "uhead_take", [int(t) for t in tags], bool(forget),
                                             self.transport.inline))

    def status(self) -> dict:
        """The recording rank's status (``uhead_status``): settings, bytes held, refused tags."""
        return recording_status([json.loads(s) for s in self._status_payloads()])

    def _one(self, payloads: list) -> CapturedRows:
        return one_payload(payloads, self.transport.inline)


class AsyncAuxClient:
    """The async face, for vLLM's ``AsyncLLM`` (the API server): its engine core always runs in
    another process. Rows of a server's concurrent requests are taken by tag; given how many rows
    to expect, the worker writes them into a shared-memory file of this engine's (the generator's
    transport, transports.py), else they travel as safetensors bytes."""

    inline = False

    def __init__(self, engine: Any):
        self._engine = weakref.ref(engine)
        self._row_shape: tuple[int, int, str] | None = None  # (columns, width, dtype) of a row
        self.counters = {"rows_in_shared_memory": 0, "rows_as_bytes": 0}

    async def _call(self, method: str, *args: Any) -> list:
        return await live_engine(self._engine).collective_rpc(method, args=args)

    async def take_tags(self, tags: list[int], forget: bool = False, expect_rows: int = 0) -> CapturedRows:
        """Only the rows of ``tags`` (the rows of other requests stay in the worker); ``forget``
        also stops recording them (a client that went away). ``expect_rows``: how many rows the
        caller expects at most (0: unknown, bytes)."""
        args = ([int(t) for t in tags], bool(forget), False)
        file = await self._row_file(expect_rows) if expect_rows > 0 else None
        if file is None:
            rows = one_payload(await self._call("uhead_take", *args), False)
        else:
            files, row_file, spec, buffer = file
            try:
                rows = one_payload(await self._call("uhead_take", *args, spec.to_json()), False)
            finally:
                files.unname(row_file)  # the worker has mapped it (or never will)
            in_file = int(rows.stats.get("rows_in_file", 0))
            if in_file:
                rows.hidden_parts = [buffer[:in_file]]
            self.counters["rows_in_shared_memory"] += in_file
        if not rows.placed:
            self.counters["rows_as_bytes"] += rows.num_rows - int(rows.stats.get("rows_in_file", 0))
        return rows

    async def _row_file(self, rows: int) -> tuple[SharedRowFiles, RowFile, SharedDestination, torch.Tensor] | None:
        """A shared row file for ``rows`` rows and the engine side's view of them (None: no room)."""
        if self._row_shape is None:
            status = await self.status()
            settings = settings_of([status])
            self._row_shape = (settings.num_columns, int(status["hidden_size"]), settings.dtype)
        columns, width, dtype = self._row_shape
        shape = (rows, columns, width)
        files = shared_row_files(live_engine(self._engine))
        taken = files.take(destination_nbytes(shape, dtype))
        if taken is None:
            return None
        row_file, flat = taken
        spec = SharedDestination(row_file.path, shape, dtype, {}, row_file.file_id, key=row_file.key,
                                 file_bytes=row_file.nbytes, keep=tuple(files.keys()))
        with torch.inference_mode(False):
            buffer = destination_on(spec, flat, tables=False).buffer
        return files, row_file, spec, buffer

    async def status(self) -> dict:
        """The recording rank's status (``uhead_status``; ``{"recording": False}`` where no rank
        records): settings, ``bytes_held``, refused tags (``tags_malformed``, ...)."""
        return recording_status([json.loads(s) for s in await self._call("uhead_status")])

    async def settings(self) -> CaptureSettings:
        """What the worker captures."""
        return settings_of([await self.status()])


def recording_status(statuses: list[dict]) -> dict:
    """The recording rank's status among every rank's (``{"recording": False}`` if none records)."""
    recording = [s for s in statuses if s.get("recording")]
    return recording[0] if recording else {"recording": False}


def settings_of(statuses: list[dict]) -> CaptureSettings:
    """The capture settings of the one recording rank among ``statuses``."""
    recording = [s for s in statuses if s.get("recording")]
    if len(recording) != 1:
        raise CaptureNotInstalledError(
            f"expected exactly one recording worker rank, found {len(recording)}: pass "
            "capture_engine_kwargs(layers) (additional_config) when building vllm.LLM"
        )
    return CaptureSettings.from_dict(recording[0]["settings"])


def one_payload(payloads: list, inline: bool) -> CapturedRows:
    """The recording rank's rows from every rank's answer (objects in process, else safetensors)."""
    payloads = [p for p in payloads if p is not None]
    if len(payloads) != 1:
        raise RuntimeError(f"expected one capture payload, got {len(payloads)}: is the worker extension "
                           "installed (--worker-extension-cls)?")
    if not inline:
        return decode_rows(payloads[0])
    if not isinstance(payloads[0], CapturedRows):
        raise TypeError(f"in-process capture take returned {type(payloads[0]).__name__}")
    return payloads[0]


class AuxBackend:
    name = "aux"

    def engine_kwargs(self, layers: Iterable[int], *, capture_dtype: str = "float32",
                      max_capture_bytes: int = 4 << 30, capture_dir: str | None = None,
                      points: Iterable[Any] = (), steering: bool = False, token_inputs: str = "") -> dict[str, Any]:
        if capture_dir is not None:
            raise ValueError("capture_dir is for the 'extract' backend; the 'aux' backend keeps rows in memory")
        return capture_engine_kwargs(layers, capture_dtype, max_capture_bytes, points=points, steering=steering,
                                     token_inputs=token_inputs)

    def owns(self, llm: Any) -> bool:
        return CAPTURE_KEY in engine_internals.additional_config(llm)

    def open_client(self, llm: Any) -> AuxClient:
        return AuxClient(llm)


AUX = AuxBackend()
