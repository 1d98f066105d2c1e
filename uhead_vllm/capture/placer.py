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

from .protocol import RowDestination


@dataclass
class ChunkSlots:
    """Where one step's chunks (one per tagged request) go: per chunk the first row and capacity
    of its request's slot and its row count; with prefix groups (:attr:`RowDestination.groups`)
    also the first rows of the slots that share its prompt prefix and how many rows each shares
    (``mirror_first`` / ``mirror_limit`` [C, M]; -1 / 0 where there are fewer than M)."""

    first: np.ndarray  # [C]
    capacity: np.ndarray  # [C]
    lens: np.ndarray  # [C]
    mirror_first: np.ndarray | None = None  # [C, M]
    mirror_limit: np.ndarray | None = None  # [C, M]


def place_step(dest: RowDestination, hidden: torch.Tensor, positions: torch.Tensor, chunks: ChunkSlots) -> None:
    """Scatter one step's rows ``hidden[r]`` to ``dest.buffer[first + positions[r]]`` (within
    capacity), and prompt rows also to the slots that share them (below each one's limit).

    The index is numpy arithmetic on a few hundred integers; the copy is one numpy fancy-index
    assignment of byte rows, which runs without the GIL. So the placer thread takes the GIL twice
    per step and never competes with the engine's Python loop for long (torch's ``index_copy_``
    here was 3-4x slower and took several GIL round trips per step).
    """
    pos = positions.numpy()
    first = np.repeat(chunks.first, chunks.lens)
    index = first + pos
    inside = (first >= 0) & (pos >= 0) & (pos < np.repeat(chunks.capacity, chunks.lens))
    rows = _byte_rows(hidden.to(dest.buffer.dtype))
    if inside.all():
        dest.byte_rows[index] = rows
    else:
        dest.byte_rows[index[inside]] = rows[inside]
    if chunks.mirror_first is None:
        return
    shared = np.flatnonzero(inside & (pos < np.repeat(chunks.mirror_limit.max(1, initial=0), chunks.lens)))
    if not shared.size:  # decode steps: every position is past its prompt
        return
    chunk = np.repeat(np.arange(len(chunks.lens)), chunks.lens)[shared]
    at = pos[shared, None]
    to = chunks.mirror_first[chunk] + at  # [S, M]
    ok = (chunks.mirror_first[chunk] >= 0) & (at < chunks.mirror_limit[chunk])
    dest.byte_rows[to[ok]] = rows[np.broadcast_to(shared[:, None], ok.shape)[ok]]


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """``t`` [R, ...] as a [R, bytes per row] uint8 numpy view (numpy has no bfloat16)."""
    return t.contiguous().view(torch.uint8).numpy().reshape(t.shape[0], -1)


class Placer:
    """FIFO of steps to place; a daemon thread works it off when steps wait on a device copy."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._seconds = 0.0

    def submit(self, ready: Any, dest: RowDestination, hidden: torch.Tensor, positions: torch.Tensor,
               chunks: ChunkSlots, done: Callable[[], None] | None = None) -> None:
        """Place a step once ``ready`` (a CUDA event, or None for rows already on the host);
        ``done`` runs after it, placed or not (it frees the step's staging memory)."""
        item = (ready, dest, hidden, positions, chunks, done)
        if ready is None and self._thread is None:
            self._place(item)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="uhead-row-placer", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def drain(self) -> tuple[str | None, float]:
        """Wait until every submitted step is placed. Returns the first error since the last
        drain, if any, and the seconds spent placing since then (waits for copies excluded)."""
        self._queue.join()
        error, self._error = self._error, None
        seconds, self._seconds = self._seconds, 0.0
        return error, seconds

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                self._place(item)
            finally:
                self._queue.task_done()

    def _place(self, item: tuple) -> None:
        ready, dest, hidden, positions, chunks, done = item
        try:
            if ready is not None:
                ready.synchronize()
            start = time.perf_counter()
            place_step(dest, hidden, positions, chunks)
            self._seconds += time.perf_counter() - start
        except Exception as exc:  # reported at fetch: the rows of this step are missing, not wrong
            if self._error is None:
                self._error = f"placing captured rows failed: {type(exc).__name__}: {exc}"
        finally:
            if done is not None:
                done()
