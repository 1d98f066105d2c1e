"""Pinned host memory reused step after step for the recorder's device-to-host copies.

Allocating pinned memory per step (``torch.empty(..., pin_memory=True)``) went through PyTorch's
caching host allocator on the engine's thread; on an H100 with 256 requests per step that call
took ~2.5 ms (two per step; bench_recorder, session 9), more than the rest of recording. So:

- rows on their way to the placer live in a :class:`PinnedRing`: the placer consumes steps
  strictly in order, and a region is free again once its rows are in their place;
- what a step keeps until the fetch (its metadata) lives in a :class:`PinnedArena`, handed out
  bump-wise and freed all at once when the generation's rows are taken.
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
        n = _aligned(nbytes)
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

    def host_copy(self, like: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """An empty host tensor shaped like ``like`` and its region's end mark (or None)."""
        region = self.take(like.numel() * like.element_size())
        return None if region is None else (_shaped(region[0], like), region[1])


class PinnedArena:
    """Pinned host memory in chunks of ``chunk_bytes`` (more for a larger request), handed out
    bump-wise and all freed by ``reset``; the chunks stay for the next generation."""

    def __init__(self, chunk_bytes: int, pin: bool = True):
        self.chunk_bytes = chunk_bytes
        self.pin = pin
        self.chunks: list[torch.Tensor] = []
        self.index = 0  # the chunk handed out from now
        self.used = 0  # bytes of it handed out

    def host_copy(self, like: torch.Tensor) -> torch.Tensor:
        """An empty host tensor shaped like ``like``, valid until ``reset``."""
        nbytes = like.numel() * like.element_size()
        n = _aligned(nbytes)
        while self.index < len(self.chunks) and self.used + n > self.chunks[self.index].numel():
            self.index, self.used = self.index + 1, 0
        if self.index == len(self.chunks):
            self.chunks.append(torch.empty(max(self.chunk_bytes, n), dtype=torch.uint8, pin_memory=self.pin))
        memory = self.chunks[self.index][self.used : self.used + nbytes]
        self.used += n
        return _shaped(memory, like)

    def reset(self) -> None:
        self.index = self.used = 0


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _shaped(memory: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return memory.view(like.dtype).view(like.shape)
