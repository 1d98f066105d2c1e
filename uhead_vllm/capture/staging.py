"""Pinned host memory reused step after step for the device-to-host copies the placer consumes.

Each step's rows travel device -> pinned host memory -> the caller's row buffer. Allocating the
pinned memory per step (``torch.empty(..., pin_memory=True)``) went through PyTorch's caching
host allocator on the engine's thread; on an H100 with 256 requests per step that call took
~2.5 ms (two per step; bench_recorder, session 9), more than the rest of recording. Steps handed to
the placer are consumed strictly in order, so one fixed pinned ring serves them all: a region is
free again as soon as the placer has written its rows to their place. (Only rows: what a step
keeps until the fetch, its metadata, must not live here.)
"""

from __future__ import annotations

import torch

#: Region alignment: every dtype's views start aligned.
_ALIGN = 64


class PinnedRing:
    """A ring of ``nbytes`` of pinned host memory, handed out in FIFO regions.

    ``take`` (the engine's thread) returns a region and its end mark, or None when the consumer is
    too far behind or the region would not fit (the caller then allocates as before: the engine
    never waits here). The consumer calls ``release(end)`` once a region's rows are placed,
    in the order regions were taken.
    """

    def __init__(self, nbytes: int, pin: bool = True):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.size = nbytes
        self.head = 0  # where the next region starts, counted without wrapping
        self.released = 0  # everything before this mark was placed (written by the consumer)

    def take(self, nbytes: int) -> tuple[torch.Tensor, int] | None:
        n = -(-nbytes // _ALIGN) * _ALIGN
        if n > self.size:
            return None
        start = self.head
        offset = start % self.size
        if offset + n > self.size:  # no region across the end: continue at the start
            start += self.size - offset
            offset = 0
        end = start + n
        if end - self.released > self.size:
            return None
        self.head = end
        return self.buffer[offset : offset + nbytes], end

    def release(self, end: int) -> None:
        self.released = max(self.released, end)

    def host_copies(self, tensors: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], int] | None:
        """Empty host tensors shaped like ``tensors`` in one region, and its end mark (or None)."""
        sizes = [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors]
        region = self.take(sum(sizes))
        if region is None:
            return None
        memory, end = region
        out, at = [], 0
        for t, size in zip(tensors, sizes):
            nbytes = t.numel() * t.element_size()
            out.append(memory[at : at + nbytes].view(t.dtype).view(t.shape))
            at += size
        return out, end
