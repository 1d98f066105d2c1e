"""Stage 2 of a generate call: one :class:`Sequence` per planned request, from vLLM's outputs.

Needs the :class:`~.plan.CallPlan` and vLLM's ``RequestOutput`` of each planned request (in plan
order). Produces the sequences with their token ids (views of one array, built in one pass over
vLLM's lists), how many rows each needs and their row-store keys. Rows and validity are set by
the first pass (first_pass.py) and completed by completion.py, whose needs a Sequence meets.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .plan import CallPlan
from .prefix_store import PrefixRowStore, buffer_address


@dataclass(slots=True)
class Sequence:
    """One sequence of the call: prompt + one sample's output, and its rows."""

    prompt_index: int
    sample: int
    prompt: str  # the prompt text
    expected: torch.Tensor  # the sequence's token ids (prompt + output), a view of the call's ids
    ids: np.ndarray  # the same memory as numpy (hashing and checks without a conversion per sequence)
    num_rows: int
    output: Any  # vLLM CompletionOutput
    request_output: Any
    last: bool = False  # the last token's row is computed (asked for, and the sequence can be forwarded)
    last_row_missing: bool = False  # asked for, but the sequence fills max_model_len
    salt: str = ""  # row-store key prefix ("" = plain unsalted)
    cache_salt: str = ""  # vLLM's cache_salt of the request (and of a recompute)
    steer_args: dict = field(default_factory=dict)  # the resolved steering spec, for a recompute
    step_salt: str = ""  # the step-cache key prefix ("" = plain unsalted)
    rows: torch.Tensor | None = None  # set by the first pass: a view of the call's row buffer
    valid: torch.Tensor | None = None  # set by the first pass
    keys: list[bytes] | None = None  # row-store keys of its full blocks
    need_from: int = 0  # rows before it are neither captured nor completed: its window's start, for the
    #                     samples of a prompt but the first the prompt's end (the first holds the prompt's rows)
    first_row: int = 0  # its capture window's start


def sequences(plan: CallPlan, request_outputs: list[Any], max_model_len: int) -> list[Sequence]:
    """One :class:`Sequence` per planned request, ``request_outputs`` in plan order."""
    parts = [(ro.prompt_token_ids, ro.outputs[0].token_ids) for ro in request_outputs]
    lens = [len(p) + len(o) for p, o in parts]
    flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(parts)), np.int64, sum(lens))
    last = plan.last
    seqs, start = [], 0
    for r, ro, expected, n in zip(plan.requests, request_outputs, torch.from_numpy(flat).split(lens), lens):
        # vLLM refuses a prompt of max_model_len tokens, so a sequence that long cannot have its
        # last token forwarded: flag it rather than lose the call.
        full = last and n >= max_model_len
        num_rows = n - (0 if last and not full else 1)
        ids, start = flat[start : start + n], start + n
        steering = r.steering
        seqs.append(Sequence(r.prompt_index, r.sample, r.prompt, expected, ids, num_rows, ro.outputs[0], ro,
                             last=last and not full, last_row_missing=full, salt=steering.salt,
                             cache_salt=steering.cache_salt, steer_args=steering.extra_args,
                             step_salt=steering.step_salt, need_from=min(r.record_from, num_rows),
                             first_row=min(r.start, num_rows)))
    return seqs


def set_row_keys(seqs: list[Sequence], store: PrefixRowStore) -> None:
    """Every sequence's row-store keys; the full blocks of a prompt are hashed once for all the
    sequences that start with it (the samples of one prompt)."""
    prompts: dict[tuple[str, tuple[int, ...]], list[bytes]] = {}
    for q in seqs:
        prompt = tuple(q.request_output.prompt_token_ids)
        known = prompts.get((q.salt, prompt))
        if known is None:
            known = prompts[(q.salt, prompt)] = store.keys(prompt, len(prompt), q.salt.encode())
        q.keys = store.keys(q.ids, q.num_rows, q.salt.encode(), known)


def occupied(seqs: list[Sequence]) -> dict[int, int]:
    """Bytes written into each of this call's row buffers (a destination buffer is allocated for
    the longest outcomes; its pages past the rows written, or below a capture window, are never
    touched)."""
    used: dict[int, int] = {}
    for q in seqs:
        assert q.rows is not None  # every sequence has its rows after the first pass
        address = buffer_address(q.rows)
        used[address] = used.get(address, 0) + q.rows[q.need_from :].numel() * q.rows.element_size()
    return used
