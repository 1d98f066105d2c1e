"""The samples of one prompt share its rows: one copy, held by sample 0.

vLLM computes a prompt once for all its samples. The plan (plan.py) has sample 0 record the
prompt's rows (within the capture window) and every other sample only its own rows, from the
prompt's end; each result's prompt part is a view of sample 0's rows (results.py). What is left
here is the row store: a sample's block that straddles the prompt's end holds rows of both
(prompt tail, own start), and a later call continuing that sample finds the block in vLLM's prefix
cache; it is stored as a block of its own (at most ``block_size`` rows per sample).
"""

from __future__ import annotations

from typing import Any

import torch

from .prefix_store import PrefixRowStore


def shared_rows(seqs: list[Any]) -> int:
    """Rows the call's samples read from another sample's copy of their prompt's rows."""
    return sum(q.need_from - q.first_row for q in seqs if q.sample)


def store_straddling_blocks(seqs: list[Any], store: PrefixRowStore) -> int:
    """Store each shared sample's block across its prompt's end, joined from the prompt's holder
    (its sample 0, earlier in ``seqs``) and its own rows; returns how many were new."""
    size, added = store.block_size, 0
    holder: dict[int, Any] = {}
    for q in seqs:
        rep = holder.setdefault(q.prompt_index, q)
        p = q.need_from
        b = p // size
        if rep is q or p % size == 0 or p <= q.first_row or not q.keys or b >= len(q.keys):
            continue
        lo, hi = b * size, (b + 1) * size
        assert rep.valid is not None and q.valid is not None and rep.rows is not None and q.rows is not None
        if bool(rep.valid[lo:p].all()) and bool(q.valid[p:hi].all()):
            with torch.inference_mode(False):
                added += store.put_block(q.keys[b], torch.cat([rep.rows[lo:p], q.rows[p:hi]]))
    return added
