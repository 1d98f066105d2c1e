"""Pinned host memory reused step after step for the recorder's device-to-host copies.

Allocating pinned memory per step (``torch.empty(..., pin_memory=True)``) went through PyTorch's
caching host allocator on the engine's thread; on an H100 with 256 requests per step that call
took ~2.5 ms (two per step; measured with experiments/gpu/bench_recorder.py), more than the rest of recording. So:

- rows on their way to the placer live in a :class:`PinnedRing`: the placer consumes steps
  strictly in order, and a region is free again once its rows are in their place;
- what a step keeps until the fetch (its metadata) lives in a :class:`PinnedArena`, handed out
  bump-wise and freed all at once when the generation's rows are taken.

:class:`HostStaging` holds both for the placing sinks (sinks/).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .cuda_streams import CopyStream

#: Region alignment: every dtype's views start aligned.
_ALIGN = 64
#: Pinned staging memory for steps the placer consumes: 40 decode steps of 256 requests x 3 layers
#: of an 8B model in bf16, so a placer a few steps behind is no cost. A step larger than a quarter
#: of it (a long prefill) gets pinned memory of its own: in the ring it left the following decode
#: steps no room until placed, and each of them then paid a 7 ms pinned allocation (bench_recorder).
STAGING_BYTES = 256 << 20
#: Pinned memory per chunk for the metadata steps keep until the take (16 bytes per row).
METADATA_CHUNK_BYTES = 4 << 20


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


class HostStaging:
    """Pinned memory of the placed steps on a GPU (each made at first use): rows in a
    :class:`PinnedRing`, metadata (positions and tokens for the placer; the device writer's slots)
    in a :class:`PinnedArena` freed at the take (:meth:`reset`)."""

    def __init__(self, copies: CopyStream) -> None:
        self.copies = copies
        self._ring: PinnedRing | None = None
        self._arena: PinnedArena | None = None

    def arena(self) -> PinnedArena:
        if self._arena is None:
            self._arena = PinnedArena(METADATA_CHUNK_BYTES)
        return self._arena

    def to_host(self, hidden: torch.Tensor, meta: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, object, Callable[[], None] | None]:
        """Host copies of a batch's rows and metadata, on a GPU asynchronously on the side stream
        (one event for both, the third value; None on CPU, where they are returned as they are:
        new tensors, never engine buffers). The fourth value frees the rows' region of the ring
        once placed (None: nothing to free; a batch larger than a quarter of the ring, or one that
        finds no room in it, gets pinned memory of its own)."""
        if hidden.device.type != "cuda":
            return hidden, meta, None, None
        if self._ring is None:
            self._ring = PinnedRing(STAGING_BYTES)
        staged = release = None
        if hidden.numel() * hidden.element_size() <= STAGING_BYTES // 4:
            staged = self._ring.host_copy(hidden)
        host_meta = self.arena().host_copy(meta)
        if staged is not None:
            host_hidden, end = staged
            release = functools.partial(self._ring.release, end)
        else:
            host_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
        event = self.copies.copy_to_host([(host_hidden, hidden), (host_meta, meta)])
        return host_hidden, host_meta, event, release

    def reset(self) -> None:
        """The take: the metadata of the generation's steps is no longer needed."""
        if self._arena is not None:
            self._arena.reset()
