"""Host-side store of captured rows, keyed the way vLLM's prefix cache keys its blocks.

A cached KV block is identified by the token ids of that block and of every block before it, so
the hidden-state rows of the block are determined by the same key. Filling a prefix-cache gap from
this store is therefore exact, not a heuristic by prompt string or longest common prefix.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch


def block_keys(token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Chained digests of the first ``num_blocks`` full blocks of ``token_ids``."""
    ids = np.asarray(token_ids, dtype=np.int64)
    keys: list[bytes] = []
    parent = b""
    for b in range(num_blocks):
        parent = hashlib.sha256(parent + ids[b * block_size : (b + 1) * block_size].tobytes()).digest()
        keys.append(parent)
    return keys


class PrefixRowStore:
    """LRU store of per-block rows ``[block_size, layers, hidden]`` under a byte budget."""

    def __init__(self, block_size: int, max_bytes: int = 1 << 30):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.max_bytes = int(max_bytes)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes_held = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes_held = 0

    def put(self, token_ids: Sequence[int], rows: torch.Tensor, valid: torch.Tensor) -> int:
        """Store every full block whose rows are all valid; returns how many blocks were new."""
        n_blocks = min(len(token_ids), rows.shape[0]) // self.block_size
        if n_blocks == 0:
            return 0
        complete = valid[: n_blocks * self.block_size].view(n_blocks, self.block_size).all(1).tolist()
        added = 0
        for b, key in enumerate(block_keys(token_ids, self.block_size, n_blocks)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            if not complete[b]:
                continue
            block = rows[b * self.block_size : (b + 1) * self.block_size].clone()
            size = block.numel() * block.element_size()
            if size > self.max_bytes:
                return added
            self._blocks[key] = block
            self.bytes_held += size
            added += 1
            while self.bytes_held > self.max_bytes:
                _, old = self._blocks.popitem(last=False)
                self.bytes_held -= old.numel() * old.element_size()
                self.evictions += 1
        return added

    def fill(self, token_ids: Sequence[int], rows: torch.Tensor, valid: torch.Tensor) -> int:
        """Fill invalid rows of full blocks from the store in place; returns rows filled."""
        n_blocks = min(len(token_ids), rows.shape[0]) // self.block_size
        if n_blocks == 0:
            return 0
        gaps = (~valid[: n_blocks * self.block_size]).view(n_blocks, self.block_size).any(1)
        if not bool(gaps.any()):
            return 0
        last_gap = int(torch.nonzero(gaps).max())
        gaps_list = gaps.tolist()
        filled = 0
        for b, key in enumerate(block_keys(token_ids, self.block_size, last_gap + 1)):
            if not gaps_list[b]:
                continue
            block = self._blocks.get(key)
            if block is None:
                continue
            self._blocks.move_to_end(key)
            s = slice(b * self.block_size, (b + 1) * self.block_size)
            missing = ~valid[s]
            rows[s][missing] = block[missing].to(rows.dtype)
            valid[s] = True
            filled += int(missing.sum())
        return filled
