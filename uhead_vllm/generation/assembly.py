"""Place captured rows at their positions in one sequence, checking every row's input token."""

from __future__ import annotations

import torch


def place_rows(
    expected_ids: torch.Tensor,
    num_rows: int,
    positions: torch.Tensor,
    token_ids: torch.Tensor,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
) -> int:
    """Write captured rows into the rows of ``rows[:num_rows]`` not yet valid (in place); mark them.

    Only a row whose input token equals the final sequence's token at that position is used, and
    of those the last one captured wins: with speculative decoding, rows after a rejected draft
    token are captured too and their positions are forwarded again later with the right token.
    Returns the number of positions written.
    """
    if positions.numel() == 0:
        return 0
    in_range = positions < num_rows
    pos = positions[in_range]
    idx = torch.nonzero(in_range).flatten()
    match = token_ids[idx] == expected_ids[pos]
    pos, idx = pos[match], idx[match]
    if pos.numel() == 0:
        return 0
    last = torch.full((num_rows,), -1, dtype=torch.int64)
    last.scatter_reduce_(0, pos, idx, reduce="amax")
    hit = (last >= 0) & ~valid  # rows already placed stay: other holders may share them
    rows[hit] = hidden[last[hit]].to(rows.dtype)
    valid |= hit
    return int(hit.sum())
