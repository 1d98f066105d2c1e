"""Rows kept in the worker until the engine side takes them (no destination).

Each step's rows are gathered on the device and copied (on a GPU asynchronously, on the side
stream, cuda_streams.py) into the next free rows of a *segment*: pinned host memory of a few
thousand rows with each row's tag, sample and chunk beside it. So recording allocates no pinned
memory per step (through PyTorch's caching host allocator that cost ~1 ms of the engine's thread
per step, staging.py), and a take is a few vectorised operations per segment, whatever the number
of steps or requests held (splitting every held step at each take cost ~7 ms of the engine's
thread per take at 64 concurrent requests on an H200). Rows never move; a segment goes once none
of its rows is left.

A tag take (a server's requests, :meth:`HeldRows.take_tags`) never waits for a forward. The engine
core serves it between steps while, with async scheduling, the next step already runs on the
device; waiting for that step's rows stalled the engine once per take. No caller needs them: a
server asks for rows of tokens it has seen, and vLLM emits a step's tokens only after its forward.
So a tag take takes rows only up to the first step whose forward still runs (each step's
``computed`` event, on the main stream after its gathers), waits for the copies before it and
leaves the rest for the next take; a forget drops those too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..cuda_streams import CopyStream
from ..protocol import CapturedRows, CaptureSettings, empty_rows
from ..step_layout import StepLayout, gathered

#: Rows per segment at most, and its bytes of hidden rows at most (a larger step gets its own).
SEGMENT_ROWS = 4096
SEGMENT_BYTES = 16 << 20


@dataclass(eq=False)
class _Segment:
    hidden: torch.Tensor  # [capacity, C, H] (pinned on a GPU machine)
    positions: torch.Tensor  # [capacity] int64
    token_ids: torch.Tensor  # [capacity] int64
    tags: np.ndarray = field(init=False)  # [capacity] per row, as samples and chunks
    samples: np.ndarray = field(init=False)
    chunks: np.ndarray = field(init=False)  # the row's chunk (request and step), numbered across segments
    alive: np.ndarray = field(init=False)  # not taken yet
    used: int = 0
    live: int = 0

    def __post_init__(self) -> None:
        n = len(self.hidden)
        self.tags, self.samples, self.chunks = (np.empty(n, np.int64) for _ in range(3))
        self.alive = np.zeros(n, dtype=bool)


@dataclass
class _Running:
    """A step whose forward may still run: its rows' first place and its events."""

    segment: _Segment
    start: int
    computed: Any  # event after its gathers, on the main stream
    copied: Any  # event after its copy to the host, on the side stream


class HeldRows:
    """The rows recorded since the last take, on the host, by segment."""

    def __init__(self, settings: CaptureSettings, hidden_size: int, copies: CopyStream) -> None:
        self.settings, self.hidden_size, self.copies = settings, hidden_size, copies
        self.segments: list[_Segment] = []
        self.running: deque[_Running] = deque()  # GPU steps not seen done yet, in order
        self._chunk_serial = 0
        self.bytes_held = 0
        self._row_shape = (settings.num_columns, hidden_size)
        self._row_bytes = settings.num_columns * hidden_size * settings.torch_dtype.itemsize

    def holds_rows(self) -> bool:
        return any(s.live for s in self.segments)

    def record(self, layout: StepLayout, picked: list[torch.Tensor], positions: torch.Tensor,
               input_ids: torch.Tensor) -> None:
        hidden, meta = gathered(picked, positions, input_ids, layout.runs, self.settings.torch_dtype)
        n = len(hidden)
        seg = self._room(n, hidden.device.type == "cuda")
        a, b = seg.used, seg.used + n
        if hidden.device.type == "cuda":
            computed = torch.cuda.Event()
            computed.record(torch.cuda.current_stream(hidden.device))
            copied = self.copies.copy_to_host([(seg.hidden[a:b], hidden), (seg.positions[a:b], meta[0]),
                                               (seg.token_ids[a:b], meta[1])])
            self.running.append(_Running(seg, a, computed, copied))
        else:
            seg.hidden[a:b] = hidden
            seg.positions[a:b], seg.token_ids[a:b] = meta
        lens, c = layout.lens, len(layout.lens)
        serials = np.arange(self._chunk_serial, self._chunk_serial + c)
        if c == n:  # decode steps: a row per chunk
            seg.tags[a:b], seg.samples[a:b], seg.chunks[a:b] = layout.tags, layout.samples, serials
        else:
            seg.tags[a:b], seg.samples[a:b] = np.repeat(layout.tags, lens), np.repeat(layout.samples, lens)
            seg.chunks[a:b] = np.repeat(serials, lens)
        seg.alive[a:b] = True
        self._chunk_serial += c
        seg.used, seg.live = b, seg.live + n
        self.bytes_held += n * self._row_bytes

    def _room(self, n: int, pinned: bool) -> _Segment:
        """The segment with room for ``n`` more rows: the last one, or a new one."""
        if self.segments and self.segments[-1].used + n <= len(self.segments[-1].hidden):
            return self.segments[-1]
        rows = max(n, min(SEGMENT_ROWS, SEGMENT_BYTES // max(self._row_bytes, 1)))
        seg = _Segment(torch.empty((rows, *self._row_shape), dtype=self.settings.torch_dtype, pin_memory=pinned),
                       torch.empty(rows, dtype=torch.int64, pin_memory=pinned),
                       torch.empty(rows, dtype=torch.int64, pin_memory=pinned))
        self.segments.append(seg)
        return seg

    def discard(self) -> None:
        self.segments.clear()
        self.running.clear()
        self.bytes_held = 0

    def take(self) -> CapturedRows:
        self.copies.synchronize()
        rows = self._rows([(s, np.flatnonzero(s.alive[: s.used])) for s in self.segments])
        rows.stats = {"forwards_replayed": 0, "place_seconds": 0.0, "rows_written_on_device": 0}
        self.discard()
        return rows

    def take_tags(self, tags: list[int], forget: bool = False) -> CapturedRows:
        """Only the rows of ``tags`` from the forwards done so far; the rows of other tags stay,
        and so do these tags' rows of forwards that still run (module docstring), unless
        ``forget``: then those are dropped."""
        copied = None
        while self.running and self.running[0].computed.query():  # forwards finish in order
            copied = self.running.popleft().copied
        if copied is not None:
            copied.synchronize()  # copies finish in order (one side stream)
        frontier = self.running[0] if self.running else None
        wanted = np.asarray(sorted({int(t) for t in tags}), dtype=np.int64)
        parts = []
        reached = False  # at or past the frontier: rows of running forwards
        for seg in self.segments:
            hit = seg.alive[: seg.used] & np.isin(seg.tags[: seg.used], wanted)
            cut = seg.used  # rows before it are of finished forwards
            if reached:
                cut = 0
            elif frontier is not None and seg is frontier.segment:
                cut, reached = frontier.start, True
            done = hit
            if cut < seg.used:
                done = hit.copy()
                done[cut:] = False
            parts.append((seg, np.flatnonzero(done)))
            gone = hit if forget else done
            seg.alive[: seg.used] &= ~gone
            count = int(gone.sum())
            seg.live -= count
            self.bytes_held -= count * self._row_bytes
        rows = self._rows(parts)
        self._free()
        return rows

    def _free(self) -> None:
        """Segments none of whose rows is left go (the last one is emptied for reuse once no
        copy into it runs)."""
        last = self.segments[-1] if self.segments else None
        waiting = {id(r.segment) for r in self.running}
        self.segments = [s for s in self.segments if s.live or s is last or id(s) in waiting]
        if last is not None and not last.live and id(last) not in waiting:
            last.used = 0

    def _rows(self, parts: list[tuple[_Segment, np.ndarray]]) -> CapturedRows:
        """The rows ``index`` of each segment, in order, as one :class:`CapturedRows` (the hidden
        rows one part per segment)."""
        layers = tuple(self.settings.layers)
        parts = [(s, i) for s, i in parts if i.size]
        if not parts:
            return empty_rows(layers, self.hidden_size, self.settings.torch_dtype, self.settings.num_columns)
        index = [torch.from_numpy(i) for _, i in parts]
        chunks = np.concatenate([s.chunks[i] for s, i in parts])
        cuts = np.flatnonzero(chunks[1:] != chunks[:-1]) + 1
        return CapturedRows(
            layers=layers,
            hidden_parts=[s.hidden.index_select(0, x) for (s, _), x in zip(parts, index)],
            tags=torch.from_numpy(np.concatenate([s.tags[i] for s, i in parts])),
            samples=torch.from_numpy(np.concatenate([s.samples[i] for s, i in parts])),
            positions=torch.cat([s.positions.index_select(0, x) for (s, _), x in zip(parts, index)]),
            token_ids=torch.cat([s.token_ids.index_select(0, x) for (s, _), x in zip(parts, index)]),
            chunk_offsets=torch.from_numpy(np.concatenate([[0], cuts, [len(chunks)]]).astype(np.int64)),
        )
