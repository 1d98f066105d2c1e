"""Writes each recorded step's rows into the engine side's :class:`RowDestination`.

On a GPU a step's rows reach pinned host memory asynchronously; a background thread waits for each
step's copy (its CUDA event) and scatters the rows into the destination, in recording order, so a
position forwarded twice (speculative decoding) ends with its last row. The engine's loop never
waits for it; ``drain`` does, once, at fetch. Without a device (rows are on the host at once) the
step is placed right away, in the caller's thread.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .. import envs
from .destination import RowDestination, shared_mark


#: Rows copied per numpy assignment when a shared prompt row fans out to the members of a group.
SHARED_WRITES_PER_COPY = 8192
#: Most queued steps the placer thread takes on one wake-up.
MAX_STEPS_PER_WAKE = 32


@dataclass
class ChunkSlots:
    """Where one step's chunks (one per tagged request) go: per chunk the first row and capacity
    of its request's slot and its row count; with prefix groups (:attr:`RowDestination.groups`)
    also its request's row of the destination's group tables (``group_row``; -1: no group)."""

    first: np.ndarray  # [C]
    capacity: np.ndarray  # [C]
    lens: np.ndarray  # [C]
    group_row: np.ndarray | None = None  # [C]

    def per_row(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's slot: its chunk's first row and capacity, repeated over the chunk's rows."""
        return np.repeat(self.first, self.lens), np.repeat(self.capacity, self.lens)

    @classmethod
    def joined(cls, parts: list["ChunkSlots"]) -> "ChunkSlots":
        """The chunks of consecutive steps as one step's."""
        rows = None if parts[0].group_row is None else np.concatenate([p.group_row for p in parts])
        return cls(np.concatenate([p.first for p in parts]), np.concatenate([p.capacity for p in parts]),
                   np.concatenate([p.lens for p in parts]), rows)


def place_step(dest: RowDestination, hidden: torch.Tensor, meta: torch.Tensor, chunks: ChunkSlots) -> None:
    """Scatter one step's rows ``hidden[r]`` to ``dest.buffer[first + positions[r]]`` (within
    capacity) and their input tokens to ``dest.tokens`` there, and prompt rows also to the slots
    that share them (below each one's limit, marked as shared, never over a row the slot's own
    request wrote). Of rows bound for one place (a position forwarded again after a rejected
    draft) the last is written. ``meta`` is ``[2, R]``: positions, input token ids.

    The index is numpy arithmetic on a few hundred integers; the copy is one numpy fancy-index
    assignment of byte rows, which runs without the GIL. So the placer thread takes the GIL twice
    per step and never competes with the engine's Python loop for long (torch's ``index_copy_``
    here was 3-4x slower and took several GIL round trips per step).
    """
    pos, tokens = meta.numpy()
    index, inside = own_places(chunks, pos)
    rows = _byte_rows(hidden.to(dest.buffer.dtype))
    if inside.all():
        dest.byte_rows[index] = rows
        dest.marks[index] = tokens
    else:
        dest.byte_rows[index[inside]] = rows[inside]
        dest.marks[index[inside]] = tokens[inside]
    if chunks.group_row is not None:
        _place_shared(dest, rows, np.arange(len(pos)), pos, tokens, np.repeat(chunks.group_row, chunks.lens), inside)


def share_written_rows(dest: RowDestination, meta: torch.Tensor, chunks: ChunkSlots) -> None:
    """The prompt rows of a step already written into ``dest`` at their own places (by the device,
    file_writer.py) fanned out to the slots that share them, as :func:`place_step` does."""
    if chunks.group_row is None:
        return
    pos, tokens = meta.numpy()
    k = np.repeat(chunks.group_row, chunks.lens)
    if not (pos < dest.reach[k]).any():  # decode steps: nothing of a prompt to share
        return
    index, inside = own_places(chunks, pos)
    _place_shared(dest, dest.byte_rows, index, pos, tokens, k, inside)


def own_places(chunks: ChunkSlots, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's place in its own slot (``first + position``) and whether it is written there:
    inside its slot, and the last of the rows bound for that place."""
    first, capacity = chunks.per_row()
    index = first + pos
    inside = (first >= 0) & (pos >= 0) & (pos < capacity)
    if index.size > 1:  # a place written twice (a position forwarded again): the last row counts
        kept = np.flatnonzero(inside)
        last = np.unique(index[kept][::-1], return_index=True)[1]
        if last.size < kept.size:
            inside = np.zeros(index.size, dtype=bool)
            inside[kept[kept.size - 1 - last]] = True
    return index, inside


def _place_shared(dest: RowDestination, rows: np.ndarray, row_at: np.ndarray, pos: np.ndarray, tokens: np.ndarray,
                  k: np.ndarray, inside: np.ndarray) -> None:
    """Prompt rows into the slots of the other members of the largest group whose limit is above
    the row's position (for two members that is the deepest group they share: the groups nest);
    a place already holding its own request's row keeps it, a place below its member's capture
    window gets none. Row ``r`` of the step is
    ``rows[row_at[r]]``."""
    shared = np.flatnonzero(inside & (pos < dest.reach[k]))
    if not shared.size:  # decode steps: every position is past its prompt
        return
    # Limits grow inward (outer groups first): skip the groups too short for the position.
    depth = (dest.chain_limit[k[shared]] <= pos[shared, None]).sum(1)
    group = dest.chain[k[shared], depth]
    shared, group = _last_per_group_position(shared, group, pos[shared])
    lo, hi = dest.group_span[group, 0], dest.group_span[group, 1]
    count = hi - lo
    member = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count - lo, count)
    src = np.repeat(shared, count)
    other = member != np.repeat(dest.member_index[k[shared]], count)  # never onto itself
    member, src = member[other], src[other]
    to = dest.member_first[member] + pos[src]
    # not a row its own request forwarded, nor one below the member's capture window
    free = (dest.marks[to] < 0) & (pos[src] >= dest.member_start[member])
    to, src = to[free], src[free]
    marks = shared_mark(tokens[src])
    source = row_at[src]
    for a in range(0, len(src), SHARED_WRITES_PER_COPY):  # a shared block fans out to every member:
        b = a + SHARED_WRITES_PER_COPY                    # bounded temporaries, not one of all copies
        dest.byte_rows[to[a:b]] = rows[source[a:b]]
        dest.marks[to[a:b]] = marks[a:b]


def _last_per_group_position(shared: np.ndarray, group: np.ndarray, pos: np.ndarray
                             ) -> tuple[np.ndarray, np.ndarray]:
    """Of the rows ``shared`` (in step order) that fan out to one group at one position, the last.

    Members that forward the same prompt positions in one step (every sample its prompt's last
    partial block; whole prompts where the engine serves no block to a request of the step that
    an earlier one of the step was given) each bring a row for every other member's place, all
    of one token at one position; those places keep only the last such row, so the earlier rows
    need no fan-out. Without this, 256 requests forwarding whole prompts that share a 16-token
    block expanded to ~1M (row, member) pairs of index arithmetic, each then dropped as a place
    its own request wrote: 24.6 ms of fan-out, 3.3 ms with it (``experiments/bench/fanout.py``).
    The rows written are the same bit for bit: per place the last candidate of the group still wins.
    """
    if shared.size < 2:
        return shared, group
    key = group.astype(np.int64) * (int(pos.max()) + 1) + pos
    last = np.unique(key[::-1], return_index=True)[1]
    if last.size == key.size:
        return shared, group
    kept = np.sort(key.size - 1 - last)
    return shared[kept], group[kept]


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """``t`` [R, ...] as a [R, bytes per row] uint8 numpy view (numpy has no bfloat16)."""
    return t.contiguous().view(torch.uint8).numpy().reshape(t.shape[0], -1)


class Placer:
    """FIFO of steps to place; a daemon thread works it off when steps wait on a device copy
    (with ``at_drain``, :meth:`drain` places them instead, see ``PLACE_AT_DRAIN_ENV`` (:mod:`uhead_vllm.envs`))."""

    def __init__(self, at_drain: bool | None = None) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._seconds = 0.0
        self.at_drain = envs.place_at_drain() if at_drain is None else at_drain
        self._held: list[tuple] = []  # at_drain: steps waiting for the drain

    def submit(self, ready: Any, dest: RowDestination, hidden: torch.Tensor | None, meta: torch.Tensor,
               chunks: ChunkSlots, done: Callable[[], None] | None = None) -> None:
        """Place a step (``meta``: positions and input tokens, see :func:`place_step`) once
        ``ready`` (a CUDA event, or None for rows already on the host); ``done`` runs after it,
        placed or not (it frees the step's staging memory). ``hidden=None``: the device already
        wrote the rows into ``dest``, only their sharing with group members is left."""
        item = (ready, dest, hidden, meta, chunks, done)
        if self.at_drain and (ready is not None or self._held):  # in order behind the steps held
            self._held.append(item)
            return
        if ready is None and self._thread is None:
            self._place([item])
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="uhead-row-placer", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def drain(self) -> tuple[str | None, float]:
        """Wait until every submitted step is placed. Returns the first error since the last
        drain, if any, and the seconds spent placing since then (waits for copies excluded)."""
        self._queue.join()
        if self._held:
            held, self._held = self._held, []
            self._place(held, _last_ready(held))
        error, self._error = self._error, None
        seconds, self._seconds = self._seconds, 0.0
        return error, seconds

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while len(items) < MAX_STEPS_PER_WAKE:  # steps that queued up while the last ones were placed
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                # One wait and one wake-up per batch, not per step, so the thread takes the
                # engine's GIL less often when it runs behind.
                self._place(items, _last_ready(items))
            finally:
                for _ in items:
                    self._queue.task_done()

    def _place(self, items: list[tuple], ready: Any = None) -> None:
        """Place ``items`` in order once ``ready`` (the last one's copy) is; each one's failure is
        its own (reported at drain), and each one's ``done`` runs either way."""
        try:
            if ready is not None:
                ready.synchronize()
            waited = None
        except Exception as exc:
            waited = exc
        for _, dest, hidden, meta, chunks, done in items:
            try:
                if waited is not None:
                    raise waited
                start = time.perf_counter()
                if hidden is None:  # written into the destination on the device: only the sharing
                    share_written_rows(dest, meta, chunks)
                else:
                    place_step(dest, hidden, meta, chunks)
                self._seconds += time.perf_counter() - start
            except Exception as exc:  # reported at fetch: the rows of this step are missing, not wrong
                if self._error is None:
                    self._error = f"placing captured rows failed: {type(exc).__name__}: {exc}"
            finally:
                if done is not None:
                    done()


def _last_ready(items: list[tuple]) -> Any:
    """The last step's copy event among ``items`` (None: all were on the host already): the copies
    complete in submission order (one copy stream), so it covers them all."""
    return next((item[0] for item in reversed(items) if item[0] is not None), None)
