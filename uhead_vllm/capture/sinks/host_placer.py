"""Rows written into the engine side's destination by the host placer, during the generation.

Steps collect in a device buffer and leave a batch at a time (step_batch.py): each batch is copied
to pinned memory (staging.py, on the side stream) and the placer thread writes it into the
destination, each row with its input token (placer.py). Only the count of rows is kept until the
take; the take waits for the last batch to be placed.
"""

from __future__ import annotations

import torch

from ..destination import RowDestination
from ..placer import ChunkSlots, Placer
from ..protocol import CapturedRows, CaptureSettings
from ..staging import HostStaging
from ..step_batch import StepBatcher
from ..step_layout import StepLayout, gathered


class HostPlacerSink:
    """One generation's placed rows at a time; the batcher (device buffers, step graphs) stays
    for the next generation, so calls stay warm."""

    #: Device memory per batch buffer (None: step_batch.py's default).
    buffer_bytes: int | None = None

    def __init__(self, settings: CaptureSettings, hidden_size: int, placer: Placer, staging: HostStaging) -> None:
        self.settings, self.hidden_size = settings, hidden_size
        self.placer, self.staging, self.copies = placer, staging, staging.copies
        self.batcher: StepBatcher | None = None
        self.destination: RowDestination | None = None
        self.rows_placed = 0  # rows sent to the destination (this generation)

    def begin(self, destination: RowDestination) -> None:
        self.destination = destination

    def holds_rows(self) -> bool:
        return bool(self.rows_placed) or (self.batcher is not None and bool(self.batcher.pending))

    def record(self, layout: StepLayout, picked: list[torch.Tensor], positions: torch.Tensor,
               input_ids: torch.Tensor) -> None:
        n_rows = layout.n_rows
        if self.batcher is None:
            self.batcher = StepBatcher(self.settings.num_columns, self.hidden_size, self.settings.torch_dtype,
                                       self.ship, self.buffer_bytes)
        if self.batcher.fits(n_rows):
            self.batcher.add(layout.slots, picked, positions, input_ids, layout.runs, n_rows)
        else:  # larger than a batch buffer (a long prefill): shipped on its own, after the batch
            self.batcher.flush()
            self.ship([(layout.slots, n_rows)],
                      *gathered(picked, positions, input_ids, layout.runs, self.settings.torch_dtype))

    def ship(self, steps: list[tuple[ChunkSlots, int]], hidden: torch.Tensor, meta: torch.Tensor) -> object:
        """Send consecutive steps' rows [R, C, H] and metadata [2, R] to the destination as one.
        Returns the CUDA event after which ``hidden`` and ``meta`` may be overwritten (None on
        CPU: at once)."""
        slots = [chunks for chunks, _ in steps]
        chunks = slots[0] if len(slots) == 1 else ChunkSlots.joined(slots)
        n_rows = sum(n for _, n in steps)
        self.rows_placed += n_rows
        return self._send(chunks, hidden, meta, n_rows)

    def _send(self, chunks: ChunkSlots, hidden: torch.Tensor, meta: torch.Tensor, n_rows: int) -> object:
        """To pinned memory, then the placer writes them."""
        assert self.destination is not None  # the sink records only between begin() and take()
        host_hidden, host_meta, ready, release = self.staging.to_host(hidden, meta)
        self.placer.submit(ready, self.destination, host_hidden, host_meta, chunks, release)
        return ready

    def discard(self) -> None:
        if self.batcher is not None:
            self.batcher.discard()

    def take(self) -> CapturedRows:
        if self.batcher is not None:
            self.batcher.flush()
        error, place_seconds = self.placer.drain()
        self.copies.synchronize()
        replayed = self.batcher.take_replayed() if self.batcher is not None else 0
        rows = CapturedRows.placed_into_destination(tuple(self.settings.layers), self.rows_placed)
        self.staging.reset()
        rows.error = error
        rows.stats = {"forwards_replayed": replayed, "place_seconds": place_seconds, "rows_written_on_device": 0}
        self.rows_placed = 0
        self.destination = None
        return rows
