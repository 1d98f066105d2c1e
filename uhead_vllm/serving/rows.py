"""Exact rows of one served sequence, whatever the prefix cache skipped.

Rows the worker captured are placed by position after checking their input token. Rows vLLM did
not compute because the prompt's KV blocks were prefix-cached come from a store keyed like the
prefix cache; whatever is still missing is recomputed in a one-token request that skips reading
the prefix cache. Nothing is zero-filled.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import torch

from ..generation.assembly import place_rows
from ..generation.prefix_store import PrefixRowStore

Recompute = Callable[[list[int]], Awaitable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]


def place_captured(expected: torch.Tensor, num_rows: int, captured, num_layers: int, hidden_size: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [num_rows, L, H], valid [num_rows])`` from captured (positions, token_ids, hidden)."""
    rows = torch.empty((num_rows, num_layers, hidden_size), dtype=dtype)
    valid = torch.zeros(num_rows, dtype=torch.bool)
    if captured is not None:
        positions, token_ids, hidden = captured
        place_rows(expected, num_rows, positions, token_ids, hidden, rows, valid)
    return rows, valid


async def complete_rows(expected: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, need_from: int,
                        store: PrefixRowStore, recompute: Recompute, salt: bytes = b"") -> dict[str, int]:
    """Make ``rows[need_from:]`` all valid (in place); returns counters of where rows came from.
    ``salt``: a steered request's cache salt, so its rows are stored and found apart from plain ones."""
    stats = {"rows_from_store": 0, "rows_recomputed": 0}
    num_rows = rows.shape[0]
    if bool(valid[need_from:].all()):
        store.put(expected, rows, valid, salt=salt)
        return stats
    if need_from < num_rows:
        stats["rows_from_store"] = store.fill(expected, rows, valid, salt=salt)
    if not bool(valid[need_from:].all()):
        before = int(valid.sum())
        positions, token_ids, hidden = await recompute(expected[:num_rows].tolist())
        place_rows(expected, num_rows, positions, token_ids, hidden.to(rows.dtype), rows, valid)
        stats["rows_recomputed"] = int(valid.sum()) - before
        if not bool(valid[need_from:].all()):
            missing = torch.nonzero(~valid[need_from:]).flatten().add(need_from).tolist()
            raise RuntimeError(f"rows at positions {missing[:10]} could not be computed; this is a bug")
    store.put(expected, rows, valid, salt=salt)
    return stats
