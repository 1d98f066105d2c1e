"""Rows written by the device straight into the engine side's shared row file (the default on a GPU).

The host placer's path (host_placer.py) with the copy to pinned memory and the host's scatter
replaced: each batch is written into the registered row file by the device itself, on the side
stream (file_writer.py; the host only sends each row's slot, 16 bytes), so the device's batch
buffers are larger (each flush costs the engine's thread its launches). Prompt rows shared by the
members of prefix groups are then fanned out by the placer from the file, once the writes are
done. Where a write fails, the placer writes that batch and the rest of the generation.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..destination import RowDestination
from ..file_writer import FileWriter
from ..placer import ChunkSlots, Placer
from ..protocol import CapturedRows, CaptureSettings
from ..staging import HostStaging
from ..step_batch import WRITER_BUFFER_BYTES
from .host_placer import HostPlacerSink


class DeviceFileSink(HostPlacerSink):
    buffer_bytes = WRITER_BUFFER_BYTES

    def __init__(self, settings: CaptureSettings, hidden_size: int, placer: Placer, staging: HostStaging) -> None:
        super().__init__(settings, hidden_size, placer, staging)
        self.writer: FileWriter | None = None  # the row file as the device writes it (None: the placer's way)
        self.rows_written_on_device = 0  # rows of this generation the device wrote

    def begin(self, destination: RowDestination, writer: FileWriter | None = None) -> None:
        super().begin(destination)
        self.writer = writer

    def _send(self, chunks: ChunkSlots, hidden: torch.Tensor, meta: torch.Tensor, n_rows: int) -> object:
        if self.writer is not None:
            try:
                event = self._write_file(chunks, hidden, meta)
            except Exception as exc:  # noqa: BLE001  (the placer writes these rows and the rest instead)
                self.writer = None
                warnings.warn(f"uhead_vllm: the device could not write the row file, the host placer takes over: "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
            else:
                self.rows_written_on_device += n_rows
                return event
        return super()._send(chunks, hidden, meta, n_rows)

    def _write_file(self, chunks: ChunkSlots, hidden: torch.Tensor, meta: torch.Tensor) -> object:
        """The device writes the rows into the registered row file (on the side stream on a GPU);
        prompt rows of prefix groups are then fanned out by the placer from the file."""
        dest, writer = self.destination, self.writer
        assert dest is not None and writer is not None  # _send calls with a writer, between begin() and take()
        places = np.stack(chunks.per_row())
        if hidden.device.type != "cuda":
            writer.write(hidden, meta, *torch.from_numpy(places))
            if dest.groups:
                self.placer.submit(None, dest, None, meta, chunks)
            return None
        arena = self.staging.arena()
        host_places = arena.host_copy(torch.empty(places.shape, dtype=torch.int64, device="meta"))
        host_places.numpy()[...] = places
        host_meta = arena.host_copy(meta) if dest.groups else None

        def write() -> None:
            slot_first, capacity = host_places.to(hidden.device, non_blocking=True)
            writer.write(hidden, meta, slot_first, capacity)
            if host_meta is not None:
                host_meta.copy_(meta, non_blocking=True)

        event = self.copies.run(hidden.device, write, (hidden, meta))
        if host_meta is not None:
            self.placer.submit(event, dest, None, host_meta, chunks)
        return event

    def take(self) -> CapturedRows:
        rows = super().take()
        rows.stats["rows_written_on_device"] = self.rows_written_on_device
        self.rows_written_on_device = 0
        self.writer = None
        return rows
