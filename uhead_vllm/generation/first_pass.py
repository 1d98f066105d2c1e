"""Stage 3 of a generate call: the first pass's rows, placed and checked.

Before the pass, :func:`request_destination` asks the worker to write rows into one buffer while
vLLM generates (needs the plan and the engine's limits; produces a
:class:`~.backends.Placement`). After it, :func:`check_capture_complete` compares what vLLM
scheduled with what the worker recorded, and :func:`place_first_pass` gives every
:class:`~.sequences.Sequence` its ``rows`` and ``valid`` (needs the captured rows and the settled
destination; produces the validity of every row, sequence after sequence). A row counts only where
its input token is the sequence's token at its position; nothing is zero-filled.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import torch

from ..capture.destination import RowDestination, shared_mark
from ..capture.protocol import CapturedRows
from ..errors import CaptureError
from .backends import CaptureClient, Placement
from .host_memory import host_buffer
from .plan import CallPlan, PlannedRequest
from .prefix_groups import groups_within_slots, prefix_groups
from .sequences import Sequence


def _physical_memory() -> int:  # a module attribute: experiments/gpu/ablate_capture.py replaces it
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def request_destination(client: CaptureClient, plan: CallPlan, *, max_model_len: int, columns: int,
                        hidden_size: int, block_size: int) -> Placement:
    """One buffer with room for every sequence's longest outcome, for the worker to write rows
    into while vLLM generates (see :class:`RowDestination`), requests grouped by the prompt
    prefixes they share (:func:`prefix_groups`); settled once the requests are sent. No
    destination when that room would exceed half the machine's memory even as untouched address
    space, or the backend cannot. Either way the rows the worker recorded before (requests made
    outside the generator) are dropped."""
    slots: dict[int, tuple[int, int]] = {}
    tags_of: dict[int, list[PlannedRequest]] = {}
    starts = {r.tag: r.record_from for r in plan.requests if r.record_from}  # capture windows (none: every row)
    first = 0
    for r in plan.requests:
        new = r.params.max_tokens if r.params.max_tokens is not None else max_model_len
        capacity = min(len(plan.sent_ids(r.prompt_index)) + new, max_model_len)
        slots[r.tag] = (first, capacity)
        first += capacity
        tags_of.setdefault(r.prompt_index, []).append(r)
    dtype = client.settings.torch_dtype
    row_bytes = columns * hidden_size * dtype.itemsize
    if first * row_bytes > _physical_memory() // 2:
        client.fetch()
        return Placement(None)
    # A prompt's rows go to its sample 0 only (the others share them, results.py): groups are of
    # the prompts, sharing whole blocks or all their tokens.
    shared = prefix_groups([(rs[0].steering.salt.encode(), plan.sent_ids(i), [rs[0].tag])
                            for i, rs in tags_of.items()], block_size)
    groups = groups_within_slots(shared, slots)
    if starts:  # a group whose shared rows all lie below its members' windows has nothing to share
        groups = [(limit, tags) for limit, tags in groups if limit > min(starts.get(t, 0) for t in tags)]
        return client.place_into(slots, (first, columns, hidden_size), groups, starts)
    return client.place_into(slots, (first, columns, hidden_size), groups)


def check_capture_complete(captured: CapturedRows, stats: Any, strict: bool, outputs: list) -> None:
    """Compare what vLLM scheduled for our requests with what the worker recorded; the worker's
    counters go into ``stats`` (a :class:`~.results.GenerationStats`).

    Cached prefix tokens are never scheduled, so a shortfall is capture missing forwards (e.g. a
    route that does not run under CUDA-graph replay): an error in strict mode, else recomputed
    and counted, with a warning, never silently.
    """
    expected = int(captured.stats.get("rows_expected", captured.num_rows))
    stats.forwards_seen = int(captured.stats.get("forwards_seen", 0))
    stats.forwards_recorded = int(captured.stats.get("forwards_recorded", 0))
    stats.forwards_replayed = int(captured.stats.get("forwards_replayed", 0))
    stats.record_seconds = float(captured.stats.get("record_seconds", 0.0))
    stats.place_seconds = float(captured.stats.get("place_seconds", 0.0))
    stats.rows_written_on_device = int(captured.stats.get("rows_written_on_device", 0))
    missed = expected - captured.num_rows
    if missed <= 0:
        return
    stats.capture_missed_rows = missed
    message = (
        f"capture missed {missed} of {expected} rows vLLM computed "
        f"({captured.stats.get('forwards_expected', '?')} forwards with our rows, "
        f"{stats.forwards_recorded} recorded); this engine's runner or version is not captured exactly"
    )
    if strict:
        raise CaptureError(f"strict mode: {message}", outputs=outputs)
    warnings.warn(f"{message}; the missing rows are recomputed with a second pass", RuntimeWarning, stacklevel=3)


def place_first_pass(seqs: list[Sequence], tags: list[int], lens: np.ndarray, captured: CapturedRows,
                     destination: RowDestination | None, plan: CallPlan, columns: int, hidden_size: int,
                     dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """Every sequence's rows in one buffer; ``seqs[i]`` is the sequence of request tag ``tags[i]``
    with ``lens[i]`` rows.

    Rows the worker wrote into ``destination`` are only checked (:func:`check_placed`); otherwise
    they are copied into a new buffer (:func:`copy_captured`). Each sequence's ``rows`` /
    ``valid`` are views of the shared buffers. Returns the rows another request of the call wrote
    (prompt rows of a prefix group) and the validity of every sequence's rows, one after another
    (each ``valid`` is a view of it).
    """
    if destination is not None and captured.num_rows and not captured.placed:
        destination = None  # the worker handed the rows over instead (e.g. it could not map the buffer)
    from_shared = 0
    if destination is not None:
        buffer = destination.buffer
        first = np.fromiter((destination.slots[t][0] for t in tags), np.int64, len(tags))
        capacity = np.fromiter((destination.slots[t][1] for t in tags), np.int64, len(tags))
        from_shared, valid = check_placed(seqs, lens, first, capacity, destination.marks, plan.rendered)
    else:
        buffer, valid = copy_captured(seqs, tags, captured, lens, columns, hidden_size, dtype)
        first, capacity = np.cumsum(lens) - lens, lens
    for q, a, n, c, v in zip(seqs, first.tolist(), lens.tolist(), capacity.tolist(), valid.split(lens.tolist())):
        q.valid = v
        if n <= c:
            q.rows = buffer[a : a + n]
        else:  # vLLM's prompt was longer than the slot planned for it: rows past it are recomputed
            with torch.inference_mode(False):
                q.rows = torch.empty((n,) + tuple(buffer.shape[1:]), dtype=buffer.dtype)
            q.rows[:c] = buffer[a : a + c]
    return from_shared, valid


def check_placed(seqs: list[Any], lens: np.ndarray, first: np.ndarray, capacity: np.ndarray,
                 marks: np.ndarray, rendered: list[tuple[Any, str]]) -> tuple[int, torch.Tensor]:
    """Which rows in the destination are right: those whose token mark is the sequence's token
    there. The worker wrote the last row forwarded at each place (a position forwarded again
    after a rejected draft counts once, with its final token) and, below a prefix group's limit,
    rows of another member, marked as shared. Those count only where every prompt ran as sent
    (the groups were built from the prompts sent): then the members' tokens agree up to the limit
    and the row is the same computation. Returns the shared rows that count and the validity of
    every sequence's rows."""
    n = np.minimum(lens, capacity)  # rows past a slot were never written
    starts = np.cumsum(n) - n
    checked = np.arange(int(n.sum()))
    expected = np.concatenate([q.ids[:k] for q, k in zip(seqs, n.tolist())])
    found = marks[np.repeat(first - starts, n) + checked]
    shared = found == shared_mark(expected)
    if shared.any() and any(list(q.request_output.prompt_token_ids) != rendered[q.prompt_index][0]["prompt_token_ids"]
                            for q in seqs):
        shared[:] = False  # vLLM ran other prompt ids than the groups were built from
    valid = (found == expected) | shared
    if not (n == lens).all():  # the checked rows among all rows
        valid, checked_rows = np.zeros(int(lens.sum()), dtype=bool), valid
        valid[np.repeat(np.cumsum(lens) - lens - starts, n) + checked] = checked_rows
    with torch.inference_mode(False):  # a normal tensor: written in place later in the call
        return int(shared.sum()), torch.from_numpy(valid)


def copy_captured(seqs: list[Sequence], tags: list[int], captured: CapturedRows, lens: np.ndarray, columns: int,
                  hidden_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The captured rows copied into a new buffer, sequence after sequence, with one vectorised
    scatter, and their validity. A captured row counts only where its tag is ours, its position
    lies inside the sequence and its input token equals the sequence's token there; with
    speculative decoding the last matching row forwarded at a position is the one that counts.
    ``dtype``: the buffer's when nothing was captured."""
    total = int(lens.sum())
    dtype = captured.hidden_parts[0].dtype if captured.num_rows else dtype
    buffer = host_buffer((total, columns, hidden_size), dtype)
    with torch.inference_mode(False):
        valid = torch.zeros(total, dtype=torch.bool)
    if not captured.num_rows or not total:
        return buffer, valid
    n = torch.from_numpy(lens)
    cum = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cum[1:] = n.cumsum(0)
    seq_tags = torch.tensor(tags, dtype=torch.int64)
    order = torch.argsort(seq_tags)
    slot = torch.searchsorted(seq_tags[order], captured.tags).clamp_(max=len(tags) - 1)
    seq = order[slot]
    pos = captured.positions
    ours = (seq_tags[seq] == captured.tags) & (pos >= 0) & (pos < n[seq])
    row = torch.where(ours, cum[seq] + pos, 0)  # index among all sequences' rows
    expected = torch.cat([q.expected[: q.num_rows] for q in seqs])
    match = ours & (captured.token_ids == expected[row])
    candidates = torch.nonzero(match).flatten()
    last = torch.full((total,), -1, dtype=torch.int64)
    last.scatter_reduce_(0, row[candidates], candidates, reduce="amax")
    hit = last >= 0
    if candidates.numel() == captured.num_rows and int(hit.sum()) == candidates.numel():
        start = 0  # every row used once: one copy, part by part (no concatenation)
        for part in captured.hidden_parts:
            buffer.index_copy_(0, row[start : start + part.shape[0]], part)
            start += part.shape[0]
    else:
        buffer[hit] = captured.hidden[last[hit]]
    return buffer, hit
