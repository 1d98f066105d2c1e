"""Host-side store of captured rows, keyed the way vLLM's prefix cache keys its blocks.

A cached KV block is identified by the token ids of that block and of every block before it, so
the hidden-state rows of the block are determined by the same key. Filling a prefix-cache gap from
this store is therefore exact, not a heuristic by prompt string or longest common prefix.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch


def block_keys(token_ids: Sequence[int] | np.ndarray, block_size: int, num_blocks: int, salt: bytes = b"",
               known: Sequence[bytes] = ()) -> list[bytes]:
    """Chained digests of the first ``num_blocks`` full blocks of ``token_ids``; ``salt`` (like
    vLLM's ``cache_salt``) starts the chain, so steered rows never serve other requests.
    ``known``: the keys of leading blocks already hashed (a prefix shared with another sequence)."""
    known = list(known[:num_blocks])
    data = memoryview(np.asarray(token_ids, dtype=np.int64).tobytes())
    width = 8 * block_size
    keys: list[bytes] = known
    parent = known[-1] if known else salt
    sha256 = hashlib.sha256
    for start in range(len(known) * width, num_blocks * width, width):
        h = sha256(parent)
        h.update(data[start : start + width])
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass(slots=True, eq=False)
class _Source:
    """Rows that stored blocks point into: one sequence's rows of a call (its blocks are
    ``(source, first row)`` pairs, so a call's thousands of blocks cost a tuple each) or one
    block's own copy."""

    rows: torch.Tensor  # [rows, L, H]
    address: int  # storage address of the buffer ``rows`` is a view of
    version: int | None  # the rows' version counter when sealed; None until the call ends


class PrefixRowStore:
    """LRU store of per-block rows ``[block_size, layers, hidden]`` under a byte budget.

    Blocks are views into the row buffers of the calls that produced them, not copies: storing a
    call's rows costs nothing. The budget therefore counts what the store keeps alive, the whole
    buffers its blocks point into (a buffer larger than the budget is stored as block copies
    instead). A block found again in a later call is re-pointed to that call's buffer, so old
    buffers are released as their blocks age out. A view shares its buffer's version counter:
    a buffer changed in place after its call (by a user editing returned rows) no longer serves
    rows; its blocks are dropped and the rows recomputed.
    """

    def __init__(self, block_size: int, max_bytes: int = 4 << 30):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.max_bytes = int(max_bytes)
        self._blocks: OrderedDict[bytes, tuple[_Source, int]] = OrderedDict()  # key -> (source, first row)
        self._unsealed: list[_Source] = []
        self._buffers: dict[int, list[int]] = {}  # storage address -> [bytes, blocks pointing into it]
        self.bytes_held = 0
        self.evictions = 0
        self.stale_drops = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()
        self._unsealed.clear()
        self._buffers.clear()
        self.bytes_held = 0

    def tensors(self) -> list[torch.Tensor]:
        """The stored blocks (for accounting of what a generator holds)."""
        size = self.block_size
        return [src.rows[start : start + size] for src, start in self._blocks.values()]

    def keys(self, token_ids: Sequence[int] | np.ndarray, num_rows: int, salt: bytes = b"", known: Sequence[bytes] = ()
             ) -> list[bytes]:
        """The keys of the full blocks of a sequence with ``num_rows`` rows (compute once, pass
        to :meth:`put` and :meth:`fill` of the same sequence); ``known``: see :func:`block_keys`."""
        return block_keys(token_ids, self.block_size, min(len(token_ids), num_rows) // self.block_size, salt, known)

    def put(self, token_ids: Sequence[int], rows: torch.Tensor, valid: torch.Tensor | None, *, seal: bool = True,
            replace: bool = False, buffer_bytes: int | None = None, salt: bytes = b"",
            keys: list[bytes] | None = None) -> int:
        """Store every full block whose rows are all valid (``valid=None``: every row is);
        returns how many blocks were new.

        ``seal=False`` leaves the blocks unversioned until :meth:`seal` (the caller still writes
        missing rows into the same buffer); ``replace=True`` re-points blocks already stored to
        ``rows`` (the newest buffer), so older buffers can be released. ``buffer_bytes`` is what
        the buffer of ``rows`` occupies when that is less than its size (pages never written).
        """
        keys = self.keys(token_ids, rows.shape[0], salt) if keys is None else keys
        n_blocks = len(keys)
        if n_blocks == 0:
            return 0
        if valid is None:
            complete = [True] * n_blocks
        else:
            complete = valid[: n_blocks * self.block_size].view(n_blocks, self.block_size).all(1).tolist()
        size = _buffer_bytes(rows) if buffer_bytes is None else min(buffer_bytes, _buffer_bytes(rows))
        copy = size > self.max_bytes
        address = buffer_address(rows)
        shared = self._source(rows, address, seal)
        blocks, block_size = self._blocks, self.block_size
        if not copy and all(complete) and blocks.keys().isdisjoint(keys):  # all new (a fresh sequence)
            blocks.update(zip(keys, zip(itertools.repeat(shared), range(0, n_blocks * block_size, block_size))))
            self._hold(address, size, n_blocks)
            self._evict()
            return n_blocks
        added = pointing = 0  # new blocks; blocks now pointing into ``rows``' buffer
        for b, key in enumerate(keys):
            old = blocks.get(key)
            if old is not None:
                blocks.move_to_end(key)
                if not (replace and complete[b]) or old[0].address == address:
                    continue
                self._release(old[0].address)
            elif not complete[b]:
                continue
            else:
                added += 1
            if copy:
                own = rows[b * block_size : (b + 1) * block_size].clone()
                blocks[key] = (self._source(own, buffer_address(own), seal), 0)
                self._hold(buffer_address(own), _buffer_bytes(own))
            else:
                blocks[key] = (shared, b * block_size)
                pointing += 1
        if pointing:
            self._hold(address, size, pointing)
        self._evict()
        return added

    def put_block(self, key: bytes, rows: torch.Tensor) -> bool:
        """Store ``rows`` (one block of its own, ``[block_size, L, H]``) under ``key`` unless a block
        is stored there; returns whether it was new."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return False
        address = buffer_address(rows)
        self._blocks[key] = (self._source(rows, address, seal=True), 0)
        self._hold(address, _buffer_bytes(rows))
        self._evict()
        return True

    def _source(self, rows: torch.Tensor, address: int, seal: bool) -> _Source:
        source = _Source(rows, address, rows._version if seal else None)
        if not seal:
            self._unsealed.append(source)
        return source

    def seal(self) -> None:
        """Stamp unversioned blocks: from now on an in-place change to their buffer retires them."""
        for source in self._unsealed:
            source.version = source.rows._version
        self._unsealed.clear()

    def fill(self, token_ids: Sequence[int], rows: torch.Tensor, valid: torch.Tensor, salt: bytes = b"",
             keys: list[bytes] | None = None, copies: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
             start: int = 0) -> int:
        """Fill invalid rows of full blocks from the store in place, from position ``start`` on
        (a capture window's: rows before it stay as they are); returns rows filled.

        With ``copies``, whole-block copies are appended there as ``(destination, source)`` for
        the caller to run (e.g. :func:`copy_all`, several at once) before reading ``rows``."""
        n_blocks = min(len(token_ids), rows.shape[0]) // self.block_size if keys is None else len(keys)
        if n_blocks == 0:
            return 0
        wanted = ~valid[: n_blocks * self.block_size]
        if start > 0:
            wanted = wanted.clone()
            wanted[:start] = False
        gaps = wanted.view(n_blocks, self.block_size).any(1)
        if not bool(gaps.any()):
            return 0
        last_gap = int(torch.nonzero(gaps).max())
        gaps_list = gaps.tolist()
        if keys is None:
            keys = block_keys(token_ids, self.block_size, last_gap + 1, salt)
        filled = 0
        for b, key in enumerate(keys[: last_gap + 1]):
            if not gaps_list[b]:
                continue
            entry = self._blocks.get(key)
            if entry is None:
                continue
            source, start = entry
            if source.version is not None and source.rows._version != source.version:
                del self._blocks[key]  # its buffer was changed in place after its call
                self._release(source.address)
                self.stale_drops += 1
                continue
            stored = source.rows[start : start + self.block_size]
            self._blocks.move_to_end(key)
            s = slice(b * self.block_size, (b + 1) * self.block_size)
            missing = wanted[s]
            n = int(missing.sum())
            if n == self.block_size and copies is not None:
                copies.append((rows[s], stored))
            elif n == self.block_size:
                rows[s].copy_(stored)
            else:
                rows[s][missing] = stored[missing].to(rows.dtype)
            valid[s] |= missing
            filled += n
        return filled

    def buffer_sizes(self) -> dict[int, int]:
        """Bytes counted for each buffer the store keeps alive, by storage address."""
        return {address: entry[0] for address, entry in self._buffers.items()}

    def _hold(self, address: int, size: int, blocks: int = 1) -> None:
        entry = self._buffers.setdefault(address, [size, 0])
        if entry[1] == 0:
            self.bytes_held += entry[0]
        entry[1] += blocks

    def _release(self, address: int) -> None:
        entry = self._buffers[address]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes_held -= entry[0]
            del self._buffers[address]

    def _evict(self) -> None:
        while self.bytes_held > self.max_bytes and self._blocks:
            _, (old, _) = self._blocks.popitem(last=False)
            self._release(old.address)
            self.evictions += 1


def copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]], threads: int = 8) -> None:
    """Run ``destination.copy_(source)`` for every pair, on several threads once there is enough
    to copy: a single thread moves ~2 GB/s into freshly mapped pages (measured on an H100 host,
    655 block copies of 393 KB), well below what the memory system allows."""
    total = sum(d.numel() * d.element_size() for d, _ in copies)
    workers = min(threads, os.cpu_count() or 1, len(copies))
    if workers <= 1 or total < (32 << 20):
        for destination, source in copies:
            destination.copy_(source)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:  # copy_ runs without the GIL
        list(pool.map(lambda pair: pair[0].copy_(pair[1]), copies))


def buffer_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _buffer_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def held_bytes(tensors: Iterable[torch.Tensor], known: dict[int, int] | None = None,
               also: dict[int, int] | None = None) -> int:
    """Bytes of the distinct buffers that ``tensors`` (views or not) and ``also`` (buffers already
    counted: address -> bytes) keep alive; ``known`` gives the occupied bytes of buffers larger
    than what was written into them."""
    known = known or {}
    seen: dict[int, int] = dict(also or {})
    for t in tensors:
        address = buffer_address(t)
        seen[address] = known.get(address, _buffer_bytes(t))
    return sum(seen.values())
