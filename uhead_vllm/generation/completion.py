"""Stage 4: complete sequences' rows, for the generator and the server alike.

A row the first pass did not capture is either in a KV block vLLM took from its prefix cache, so
its rows are in the row store (keyed like the prefix cache, by the request's cache salt too), or
it is recomputed: the sequence is forwarded once more as a one-token request (prefix cache not
read where rows are missing) and its captured rows are placed by position after checking their
input token. Nothing is ever zero-filled; a row that still cannot be made is an error.

Needs sequences that meet :class:`RowsToComplete` (rows and validity from the first pass) and a
*forward*: the caller's way of running :class:`Recompute` requests and taking back their rows.
Produces the rows in place, the completed blocks in the store, and :class:`Completed` counters.
:meth:`RowCompletion.complete` runs with a blocking forward (the generator, one call at a time),
:meth:`RowCompletion.complete_async` with an awaitable one (the server, requests interleaved).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Sequence

import numpy as np
import torch

from ..capture.protocol import CapturedRows, RequestTag
from ..errors import MissingRowsError
from .assembly import place_rows
from .prefix_store import PrefixRowStore, buffer_address, copy_all


class RowsToComplete(Protocol):
    """What completion needs of one sequence (the generator's Sequence, the server's SequenceRows)."""

    expected: torch.Tensor  # token ids (prompt + output), int64, at least ``num_rows`` of them
    num_rows: int
    rows: torch.Tensor  # [num_rows, columns, H]; written in place
    valid: torch.Tensor  # [num_rows] bool; written in place
    salt: str  # row-store key prefix
    cache_salt: str  # vLLM cache_salt of a recompute ("" = none)
    steer_args: dict  # steering of a recompute
    need_from: int  # its capture window's start: rows before it are neither filled nor recomputed
    last: bool  # the last row is the last token's: always computed, never a prefix-cache gap
    keys: list[bytes] | None  # row-store keys of its full blocks (None: computed here)


@dataclass(slots=True)
class SequenceRows:
    """One sequence's rows being completed (what the server completes, one choice at a time)."""

    expected: torch.Tensor
    num_rows: int
    rows: torch.Tensor
    valid: torch.Tensor
    salt: str = ""
    cache_salt: str = ""
    steer_args: dict = field(default_factory=dict)
    need_from: int = 0
    last: bool = False
    keys: list[bytes] | None = None

    @classmethod
    def captured(cls, expected: torch.Tensor, num_rows: int,
                 captured: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, columns: int, hidden_size: int,
                 dtype: torch.dtype, **kw: Any) -> "SequenceRows":
        """A sequence whose rows so far are the captured ``(positions, input token ids, hidden)``."""
        rows, valid = _placed(expected, 0, num_rows, captured, columns, hidden_size, dtype)
        return cls(expected, num_rows, rows, valid, **kw)


def _placed(ids: torch.Tensor, start: int, num_rows: int,
            captured: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, columns: int, hidden_size: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of positions ``start .. start + num_rows - 1`` (``ids``: the sequence's token ids from
    ``start`` on) from the captured ``(positions, input token ids, hidden)``, and which are valid."""
    rows = torch.empty((num_rows, columns, hidden_size), dtype=dtype)
    valid = torch.zeros(num_rows, dtype=torch.bool)
    if captured is not None:
        positions, token_ids, hidden = captured
        if start:
            mine = (positions >= start).nonzero().flatten()
            positions, token_ids, hidden = positions[mine] - start, token_ids[mine], hidden[mine]
        place_rows(ids, num_rows, positions, token_ids, hidden, rows, valid)
    return rows, valid


def rows_from(ids: torch.Tensor, start: int,
              captured: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, columns: int, hidden_size: int,
              dtype: torch.dtype) -> torch.Tensor | None:
    """The rows of positions ``start .. start + len(ids) - 2`` (``ids``: the sequence's token ids
    from ``start`` on, e.g. its generated ones) from the captured ``(positions, input token ids,
    hidden)``, checked against ``ids``; None where one is missing. Only these rows are assembled
    (a running sequence's generated rows at each of its step ends), so the cost does not grow with
    the prompt."""
    rows, valid = _placed(ids, start, max(len(ids) - 1, 0), captured, columns, hidden_size, dtype)
    return rows if bool(valid.all()) else None


@dataclass(frozen=True)
class Recompute:
    """One request that forwards a sequence again: send ``prompt`` with ``params``; its rows are
    recorded under ``tag`` (sample 0)."""

    tag: int
    prompt: dict
    params: Any  # vllm.SamplingParams


@dataclass
class Completed:
    """Where completed rows came from."""

    rows_from_store: int = 0
    rows_recomputed: int = 0
    recompute_requests: int = 0
    rows_forwarded: int = 0  # rows the recompute requests recorded
    rows_skipped: int = 0  # rows they forwarded below their capture windows (not recorded)
    bytes_to_host: int = 0  # bytes of the rows they recorded


#: Runs the requests and returns the rows captured for their tags (the caller's transport).
Forward = Callable[[list[Recompute]], CapturedRows]
AsyncForward = Callable[[list[Recompute]], Awaitable[CapturedRows]]


class RowCompletion:
    """Completes rows against one row store of ``max_bytes`` (one per generator, one per server);
    ``new_tag`` gives the capture tag of each recompute request."""

    def __init__(self, block_size: int, max_bytes: int, new_tag: Callable[[], int]):
        self.store = PrefixRowStore(block_size, max_bytes)
        self.new_tag = new_tag

    def complete(self, seqs: Sequence[RowsToComplete], forward: Forward, *, strict: bool = False,
                 joint: tuple[torch.Tensor, np.ndarray] | None = None,
                 occupied: dict[int, int] | None = None) -> Completed:
        """Complete a whole call's rows (the generator). The call's complete blocks go into the store
        first, unsealed, so its sequences fill each other's gaps; sealed once every row is in.

        ``joint``: every sequence's validity in one tensor and the bounds of each (their ``valid``
        are views of it), so counts take one pass; ``occupied``: bytes written per row buffer
        (see :meth:`PrefixRowStore.put`); ``strict``: prefix-cache gaps the store cannot fill
        raise :class:`MissingRowsError` instead of being recomputed."""
        store, done, occupied = self.store, Completed(), occupied or {}
        complete = (_missing(seqs, joint, from_need=False) == 0).tolist()
        keys = [_keys(q, store) for q in seqs]
        try:
            for q, k, whole in zip(seqs, keys, complete):  # views of the call's rows, no copy
                store.put(q.expected, q.rows, None if whole else q.valid, seal=False, replace=True, keys=k,
                          buffer_bytes=occupied.get(buffer_address(q.rows)))
            self._fill(seqs, keys, _missing(seqs, joint), done, copies=True)
            todo = [q for q, n in zip(seqs, _missing(seqs, joint)) if n]
            if todo:
                requests = self._requests(todo, strict)
                _place(todo, requests, forward(requests), done)
            for q, k, whole in zip(seqs, keys, complete):
                if not whole:  # blocks completed by the fill or the recompute
                    store.put(q.expected, q.rows, q.valid, seal=False, replace=True, keys=k,
                              buffer_bytes=occupied.get(buffer_address(q.rows)))
        finally:
            store.seal()
        return done

    async def complete_async(self, seqs: Sequence[RowsToComplete], forward: AsyncForward) -> Completed:
        """Complete rows of a few sequences (the server). Rows are stored only once complete:
        other requests' completions run while this one awaits its forward."""
        store, done = self.store, Completed()
        keys = [_keys(q, store) for q in seqs]
        self._fill(seqs, keys, _missing(seqs, None), done, copies=False)
        todo = [q for q, n in zip(seqs, _missing(seqs, None)) if n]
        if todo:
            requests = self._requests(todo, False)
            _place(todo, requests, await forward(requests), done)
        for q, k in zip(seqs, keys):
            store.put(q.expected, q.rows, q.valid, keys=k)
        return done

    def _fill(self, seqs: Sequence[RowsToComplete], keys: list[list[bytes]], missing: np.ndarray,
              done: Completed, copies: bool) -> None:
        """Rows of full blocks from the store (whole-block copies run together at the end)."""
        pending: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if copies else None
        for q, k, n in zip(seqs, keys, missing.tolist()):
            if n:
                done.rows_from_store += self.store.fill(q.expected, q.rows, q.valid, keys=k, copies=pending,
                                                        start=q.need_from)
        if pending:
            copy_all(pending)

    def _requests(self, todo: list[RowsToComplete], strict: bool) -> list[Recompute]:
        """One request per sequence in ``todo``, recording only its capture window; reading the
        prefix cache is skipped where a row of the window before the last is missing (its KV may
        be cached, its rows are not)."""
        from vllm import SamplingParams

        gaps = [not bool(q.valid[q.need_from : q.num_rows - int(q.last)].all()) for q in todo]
        if strict and any(gaps):
            n = sum(int((~q.valid[q.need_from :]).sum()) for q, gap in zip(todo, gaps) if gap)
            raise MissingRowsError(
                f"strict mode: {n} rows of {sum(gaps)} sequence(s) were served from vLLM's prefix "
                f"cache and are not in the row store (budget {self.store.max_bytes} bytes, "
                f"{len(self.store)} blocks held); raise store_max_bytes or disable strict mode to "
                "recompute them")
        requests = []
        for q, gap in zip(todo, gaps):
            tag = self.new_tag()
            prompt = {"prompt_token_ids": q.expected[: q.num_rows].tolist()}
            if q.cache_salt:
                prompt["cache_salt"] = q.cache_salt
            params = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=gap,
                                    extra_args={**RequestTag(tag, 0, q.need_from).to_extra_args(), **q.steer_args})
            requests.append(Recompute(tag, prompt, params))
        return requests


def _keys(q: RowsToComplete, store: PrefixRowStore) -> list[bytes]:
    return q.keys if q.keys is not None else store.keys(q.expected, q.num_rows, q.salt.encode())


def missing_rows(seqs: Sequence[RowsToComplete], joint: tuple[torch.Tensor, np.ndarray] | None) -> np.ndarray:
    """Rows of each sequence's capture window not (yet) valid (``joint``: see :meth:`RowCompletion.complete`)."""
    return _missing(seqs, joint)


def _missing(seqs: Sequence[RowsToComplete], joint: tuple[torch.Tensor, np.ndarray] | None,
             from_need: bool = True) -> np.ndarray:
    """Rows not (yet) valid per sequence, from its ``need_from`` on (``from_need=False``: all of
    them); with ``joint`` in one pass over the call's validity, not one reduction per sequence."""
    if joint is None:
        return np.fromiter((int((~q.valid[q.need_from if from_need else 0 :]).sum()) for q in seqs), np.int64,
                           len(seqs))
    valid, bounds = joint
    counts = np.zeros(valid.numel() + 1, dtype=np.int64)
    np.cumsum(~valid.numpy(), out=counts[1:])
    starts = bounds[:-1]
    if from_need and any(q.need_from for q in seqs):
        starts = np.minimum(starts + np.fromiter((q.need_from for q in seqs), np.int64, len(seqs)), bounds[1:])
    return counts[bounds[1:]] - counts[starts]


def _place(todo: list[RowsToComplete], requests: list[Recompute], captured: CapturedRows, done: Completed) -> None:
    """The recomputed rows into their sequences (``todo[i]`` was sent as ``requests[i]``)."""
    before = [int(q.valid.sum()) for q in todo]
    done.rows_forwarded += captured.num_rows
    done.rows_skipped += int(captured.stats.get("rows_skipped", 0))
    done.bytes_to_host += int(captured.stats.get("bytes_to_host", 0))
    done.recompute_requests += len(todo)
    if captured.num_rows:
        by_tag = {r.tag: q for r, q in zip(requests, todo)}
        order = torch.argsort(captured.tags, stable=True)
        uniq, counts = torch.unique_consecutive(captured.tags[order], return_counts=True)
        start = 0
        for t, c in zip(uniq.tolist(), counts.tolist()):
            idx = order[start : start + c]
            start += c
            q = by_tag.get(t)
            if q is not None:
                place_rows(q.expected, q.num_rows, captured.positions[idx], captured.token_ids[idx],
                           captured.hidden[idx], q.rows, q.valid)
    for q, b in zip(todo, before):
        done.rows_recomputed += int(q.valid.sum()) - b
        if not bool(q.valid[q.need_from :].all()):
            missing = torch.nonzero(~q.valid[q.need_from :]).flatten().add(q.need_from).tolist()
            raise RuntimeError(f"rows at positions {missing[:10]} could not be computed; this is a bug")


__all__ = ["AsyncForward", "Completed", "Forward", "Recompute", "RowCompletion", "RowsToComplete", "SequenceRows",
           "rows_from"]
