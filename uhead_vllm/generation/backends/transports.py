"""How the aux client reaches the worker, chosen once per engine (as vLLM's ``make_client`` does).

- :class:`InProcess`: the only worker runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  one rank): RPC results are handed over as objects and rows are placed into a plain host tensor,
  nothing is serialised.
- :class:`EngineProcess`: the engine core runs in another process: rows are placed into a
  shared-memory file both sides map (handed over without waiting for the worker's reply), other
  rows travel as safetensors bytes, and a take is sent ahead of the caller's other work.

Both take the engine as an argument (the client holds it weakly: a cached client never keeps an
engine alive).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch

from ...adapters import engine as engine_internals
from ...capture.destination import UNWRITTEN, RowDestination
from ...capture.protocol import CaptureSettings, SharedDestination
from ...capture.row_files import destination_nbytes, destination_on
from ... import envs
from ..host_memory import host_buffer
from ..shared_rows import SharedRowFiles
from .base import Placement

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


class InProcess:
    """The worker is in this process: results are objects, destinations plain host tensors."""

    inline = True

    def call(self, llm: Any, method: str, *args: Any) -> list:
        return llm.collective_rpc(method, args=args)

    def send(self, llm: Any, method: str, *args: Any) -> Callable[[], list]:
        """The call, made now (an in-process engine core only moves when stepped)."""
        results = self.call(llm, method, *args)
        return lambda: results

    def begin(self, llm: Any, settings: CaptureSettings, slots: dict[int, tuple[int, int]],
              shape: tuple[int, int, int], groups: list[tuple[int, tuple[int, ...]]],
              starts: dict[int, int] | None = None) -> Placement:
        destination = RowDestination(host_buffer(shape, settings.torch_dtype), slots, list(groups), starts=starts or {})
        placed = any(self.call(llm, "uhead_begin", destination))
        return Placement(destination if placed else None)


class EngineProcess:
    """The engine core is in another process: shared-memory files, safetensors, calls sent ahead."""

    inline = False

    def call(self, llm: Any, method: str, *args: Any) -> list:
        return llm.collective_rpc(method, args=args)

    def send(self, llm: Any, method: str, *args: Any) -> Callable[[], list]:
        """Send the call without waiting for it (the engine core handles its input in order);
        the returned call waits for its results. Where the engine has no such client (data
        parallelism) the call is made now."""
        sent = engine_internals.send_collective_rpc(llm, method, args)
        if sent is None:
            results = self.call(llm, method, *args)
            return lambda: results
        return sent

    def begin(self, llm: Any, settings: CaptureSettings, slots: dict[int, tuple[int, int]],
              shape: tuple[int, int, int], groups: list[tuple[int, tuple[int, ...]]],
              starts: dict[int, int] | None = None) -> Placement:
        files = shared_row_files(llm)
        taken = files.take(destination_nbytes(shape, settings.dtype))
        if taken is None:  # no room in shared memory: the rows come back with the take
            self.call(llm, "uhead_begin", None)
            return Placement(None)
        row_file, flat = taken
        spec = SharedDestination(row_file.path, shape, settings.dtype, slots, row_file.file_id, list(groups),
                                 row_file.key, row_file.nbytes, tuple(files.keys()), envs.file_writes(), dict(starts or {}))
        with torch.inference_mode(False):  # the row store relies on the buffer's version counter
            destination = destination_on(spec, flat, tables=False)
        destination.marks.fill(UNWRITTEN)  # a file handed out again holds an earlier call's marks
        # Both sides hold their mappings once the worker answered: the memory goes with the last one.
        unname = functools.partial(files.unname, row_file)
        payload = spec.to_json()
        sent = engine_internals.send_collective_rpc(llm, "uhead_begin", (payload,))
        ask = sent or functools.partial(self.call, llm, "uhead_begin", payload)
        placement = Placement(destination, lambda: any(ask()), unname)
        if sent is None or envs.settle_placement():
            placement.settle()  # ask now, before the requests are sent (see SETTLE_PLACEMENT_ENV)
        return placement


def transport_for(llm: Any) -> InProcess | EngineProcess:
    """The transport of ``llm`` (a ``vllm.LLM``): in process when its only worker runs here."""
    return InProcess() if engine_internals.worker_in_process(llm) else EngineProcess()
