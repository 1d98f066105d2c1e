"""Placed steps' rows gathered in device memory and sent to the host a batch of steps at a time.

A decode step of a small model is a few milliseconds of host work in vLLM, so every torch call the
recorder makes per step shows in throughput (SmolLM2 shape on an H100: ~0.28 ms of recording per
step, a dozen calls, was 6% of the step). Here a step costs one call that copies its rows,
positions and token ids into a persistent buffer (on a GPU a recurring step's copy replays as one
CUDA graph, step_graphs.py); once a batch holds :data:`MAX_STEPS` steps or :data:`FLUSH_ROWS`
rows, or the buffer is full, the batch is shipped as one: one asynchronous copy moves it to pinned
host memory and the placer writes it, or (opt-in) the device writes it straight into the row file
(file_writer.py). Two buffers alternate: one fills while the other is being shipped, and the main stream
waits (on the device, never the host) for a buffer's shipping before writing into it again.

On CPU the same path runs with one host buffer and nothing in flight: a batch is placed at flush.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import envs
from .step_graphs import StepGraphs

#: Device memory per buffer (two on a GPU): 18 decode steps of 256 requests x 3 layers of SmolLM2's
#: shape in bf16, 2 of an 8B model's (larger batches took the pinned staging ring's room faster than
#: the placer freed it: 8 ms pinned allocations instead, bench_recorder). Larger steps go alone.
BUFFER_BYTES = 16 << 20
#: The same when the device writes the row file (file_writer.py): no staging ring to outrun, and
#: each flush costs the engine's thread its launches, which the 8B shape paid 64 times a call at
#: 16 MiB (two steps of 256 sequences; 10 fit here).
WRITER_BUFFER_BYTES = 64 << 20
#: A batch is sent once it holds this many rows: bounds the rows the placer still has to place
#: when the generation ends (SmolLM2's shape: ~14 MB, a few ms). It binds when steps have more than
#: 256 rows (16 steps of 256 reach it).
FLUSH_ROWS = 4096
#: Steps per batch at most (bounds how far the placer runs behind, and the offsets a steady batch
#: writes at, so its step graphs). Fewer, larger batches for small batches of sequences (64 steps:
#: 2 flushes instead of 8 at 16 sequences) were not shown to help: on H100 hosts at 3b34a17 the
#: engine thread's recording grew (more layouts to capture) and the throughput differences were
#: within what two identically configured engines differed by (measured on an H100).
MAX_STEPS = 16


#: Called once per flush: ``(steps, rows, meta)`` with each step's ``(facts, rows)`` in recording
#: order and the batch's rows [R, C, H] and metadata [2, R] (positions, token ids) one after
#: another, in the buffer (on a GPU they stay there until the returned CUDA event, which the
#: main stream waits for before writing the buffer again; on CPU they are valid during the call
#: only, and None is returned).
Ship = Callable[[list[tuple[Any, int]], torch.Tensor, torch.Tensor], Any]


#: Most cached target views per buffer (a few dozen (offset, rows) pairs recur in steady decoding).
MAX_CACHED_VIEWS = 4096


@dataclass
class _Buffer:
    rows: torch.Tensor  # [capacity, C, H]
    meta: torch.Tensor  # [2, capacity] int64: positions, token ids
    copied: Any = None  # CUDA event: the last copy out of this buffer is done
    _views: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)

    def views(self, offset: int, n: int) -> list[torch.Tensor]:
        """Where ``n`` rows written at ``offset`` go: one view per column, then the positions and
        the token ids. Cached: decode steps write the same (offset, rows) pairs again and again,
        and five fresh views cost the engine's thread microseconds every step."""
        found = self._views.get((offset, n))
        if found is None:
            if len(self._views) >= MAX_CACHED_VIEWS:
                self._views.clear()
            rows, meta = self.rows[offset : offset + n], self.meta[:, offset : offset + n]
            found = self._views[(offset, n)] = [*rows.unbind(1), *meta.unbind(0)]
        return found


class StepBatcher:
    """Accumulates steps (each a few row runs of the forward's outputs) until a flush."""

    def __init__(self, columns: int, hidden: int, dtype: torch.dtype, ship: Ship, buffer_bytes: int | None = None) -> None:
        self.columns, self.hidden, self.dtype = columns, hidden, dtype
        self.ship = ship
        self.capacity = max(1, (buffer_bytes or BUFFER_BYTES) // (columns * hidden * dtype.itemsize))
        self.max_steps, self.flush_rows = _batch_limits()
        self._buffers: list[_Buffer] = []
        self._active = 0
        self._used = 0  # rows of the active buffer written
        self._pending: list[tuple[Any, int]] = []  # (facts, rows) of the steps in the active buffer
        self.graphs: StepGraphs | None = None  # on a GPU: recurring step copies as CUDA graphs

    @property
    def pending(self) -> int:
        """Steps written and not yet flushed."""
        return len(self._pending)

    def fits(self, n_rows: int) -> bool:
        """Whether a step of ``n_rows`` goes through the buffers (else the caller copies it alone,
        after :meth:`flush`)."""
        return n_rows <= self.capacity

    def add(self, facts: Any, picked: list[torch.Tensor], positions: torch.Tensor, input_ids: torch.Tensor,
            runs: list[tuple[int, int]], n_rows: int) -> None:
        """Write rows ``[a, b)`` of every tensor of ``picked`` (one column each) and of the positions
        and token ids, for each run, into the active buffer; ``facts`` come back in the sink."""
        if not self._buffers:
            self._allocate(picked[0].device)
        if self._used + n_rows > self.capacity:
            self.flush()
        buf, start = self._buffers[self._active], self._used
        o, targets, sources = start, [], []
        for a, b in runs:
            targets += buf.views(o, b - a)
            sources += [_rows(t, a, b) for t in (*picked, positions, input_ids)]
            o += b - a
        if self.graphs is not None and len(runs) == 1:
            self.graphs.copy((self._active, start, n_rows), targets, sources)
        else:
            _copy_all(targets, sources)
        self._used = o
        self._pending.append((facts, n_rows))
        if len(self._pending) >= self.max_steps or o >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        """Ship the active buffer's steps (on a GPU, switch to the other buffer meanwhile)."""
        if not self._pending:
            return
        buf, used, pending = self._buffers[self._active], self._used, self._pending
        self._pending, self._used = [], 0
        buf.copied = self.ship(pending, buf.rows[:used], buf.meta[:, :used])
        if buf.rows.device.type == "cuda":
            self._active = (self._active + 1) % len(self._buffers)
            following = self._buffers[self._active]
            if following.copied is not None:  # its last batch must have left before it is written
                torch.cuda.current_stream(following.rows.device).wait_event(following.copied)

    def take_replayed(self) -> int:
        """Step copies replayed as CUDA graphs since the last take (0 without graphs)."""
        return 0 if self.graphs is None else self.graphs.take_replayed()

    def discard(self) -> None:
        """Forget the steps not yet flushed (the recorder dropped its rows)."""
        self._pending, self._used = [], 0

    def _allocate(self, device: torch.device) -> None:
        count = 2 if device.type == "cuda" else 1
        if device.type == "cuda" and envs.step_graphs():
            self.graphs = StepGraphs(_copy_all)
        self._buffers = [_Buffer(torch.empty((self.capacity, self.columns, self.hidden), dtype=self.dtype, device=device),
                                 torch.empty((2, self.capacity), dtype=torch.int64, device=device))
                         for _ in range(count)]


def _batch_limits() -> tuple[int, int]:
    """Steps and rows per batch at most: ``UHEAD_STEP_BATCH`` (:mod:`uhead_vllm.envs`) if set, else the defaults."""
    return envs.step_batch() or (MAX_STEPS, FLUSH_ROWS)


def _rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows ``[a, b)`` of ``t``; ``t`` itself when that is all of it (an unpadded forward)."""
    return t if a == 0 and b == t.shape[0] else t[a:b]


#: One call copies every (target, source) pair, converting dtypes as ``copy_`` does: per step the
#: engine's thread pays one call into torch, not one per tensor (``torch.foreach.copy_`` is the
#: public beta name in newer torch, ``torch._foreach_copy_`` the name it keeps for compatibility).
_copy_all = getattr(getattr(torch, "foreach", None), "copy_", None) or torch._foreach_copy_
