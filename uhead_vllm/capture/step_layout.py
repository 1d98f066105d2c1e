"""Where one forward's tagged rows are, and their gather into new tensors.

Per step the recorder needs, for the tagged requests with rows in the forward, their chunks (one
per request), the slots those go to in the destination and the row ranges to gather. As numpy index
math on per-request arrays, built once per batch and reused while vLLM repeats the batch (decode
steps), so a steady decode step costs no Python loop over requests. A chunk with rows below its
request's capture window keeps only its rows from the window's start on (a chunk entirely below
has none): those rows are never gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .destination import RowDestination
from .placer import ChunkSlots
from .protocol import RequestTag


@dataclass
class BatchFacts:
    """Per-request capture facts of one batch (row order of a forward), as arrays. Decode steps
    repeat the same batch, so it is built once and reused until the requests or their tags change."""

    req_ids: list[str]
    tagged: np.ndarray  # [K] indices (into the batch) of tagged requests
    tags: np.ndarray  # [K]
    samples: np.ndarray  # [K]
    first: np.ndarray  # [K] first row of the tag's slot in the destination (-1: none)
    capacity: np.ndarray  # [K] rows of that slot
    group_row: np.ndarray | None  # [K] row of the destination's group tables (None: no groups)

    _layout: "StepLayout | None" = None  # the last forward's row layout (decode steps repeat it)

    @classmethod
    def of(cls, req_ids: list[str], tag_of: Callable[[str], RequestTag | None],
           dest: RowDestination | None) -> "BatchFacts":
        """The facts of the batch ``req_ids`` (``tag_of``: a request's tag) for ``dest``."""
        found = [(i, tag) for i, tag in enumerate(map(tag_of, req_ids)) if tag is not None]
        slots = dest.slots if dest is not None else {}
        where = [slots.get(t.tag, (-1, 0)) for _, t in found]
        group_row = None
        if dest is not None and dest.groups:  # -1: the tables' "no group" row
            group_row = np.asarray([dest.group_row.get(t.tag, -1) for _, t in found], dtype=np.int64)
        return cls(req_ids=list(req_ids), tagged=np.asarray([i for i, _ in found], dtype=np.int64),
                   tags=np.asarray([t.tag for _, t in found], dtype=np.int64),
                   samples=np.asarray([t.sample for _, t in found], dtype=np.int64),
                   first=np.asarray([a for a, _ in where], dtype=np.int64),
                   capacity=np.asarray([n for _, n in where], dtype=np.int64), group_row=group_row)

    def layout(self, qsl: np.ndarray, below: dict[str, int] | None = None) -> "StepLayout | None":
        """Where this forward's tagged rows are (None: no tagged request has rows in it), reused
        while the token counts per request (``qsl``, host) stay those of the last forward.
        ``below``: requests whose first rows lie below their capture window -> how many (a
        Python loop over the tagged requests only in such steps, prefills of windowed requests)."""
        key, skip = qsl.tobytes(), None
        if below:
            skip = np.fromiter((below.get(self.req_ids[i], 0) for i in self.tagged.tolist()), np.int64,
                               len(self.tagged))
            key += b"|" + skip.tobytes()
        if self._layout is None or self._layout.key != key:
            self._layout = StepLayout.of(self, qsl, key, skip)
        return self._layout if self._layout.n_rows else None


@dataclass
class StepLayout:
    """One forward's tagged rows: the chunks (one per tagged request with rows), their facts for
    the placer, and the row ranges to gather. Built once per batch and token counts."""

    key: bytes  # the forward's query_start_loc, as bytes
    tags: np.ndarray  # [C]
    samples: np.ndarray  # [C]
    slots: ChunkSlots  # where the chunks go in the destination, with their rows per chunk
    runs: list[tuple[int, int]]  # row ranges of the forward to gather (adjacent chunks merged)
    n_rows: int

    @property
    def lens(self) -> np.ndarray:
        """[C] rows per chunk."""
        return self.slots.lens

    @classmethod
    def of(cls, batch: BatchFacts, qsl: np.ndarray, key: bytes, skip: np.ndarray | None = None) -> "StepLayout":
        """``skip``: per tagged request, its leading rows below its capture window (None: none)."""
        firsts = qsl[batch.tagged].astype(np.int64)
        if skip is not None:
            firsts = firsts + skip
        scheduled = (qsl[batch.tagged + 1] > firsts).nonzero()[0]  # chunks with rows (in their windows)
        chunk_req = batch.tagged[scheduled]
        starts, ends = firsts[scheduled], qsl[chunk_req + 1].astype(np.int64)
        lens = ends - starts
        rows = None if batch.group_row is None else batch.group_row[scheduled]
        return cls(key, batch.tags[scheduled], batch.samples[scheduled],
                   ChunkSlots(batch.first[scheduled], batch.capacity[scheduled], lens, rows),
                   _runs(starts, ends) if scheduled.size else [], int(lens.sum()))


def gathered(picked: list[torch.Tensor], positions: torch.Tensor, input_ids: torch.Tensor,
             runs: list[tuple[int, int]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """New tensors of the runs' rows [R, C, H] (in ``dtype``) and metadata [2, R] (positions,
    token ids): never views of the engine's buffers, which the next forward overwrites."""
    hidden_parts, meta_parts = [], []
    for a, b in runs:
        hidden_parts.append(torch.stack([h[a:b] for h in picked], dim=1))
        meta_parts.append(torch.stack([positions[a:b].to(torch.int64), input_ids[a:b].to(torch.int64)]))
    hidden = (hidden_parts[0] if len(hidden_parts) == 1 else torch.cat(hidden_parts)).to(dtype)
    meta = meta_parts[0] if len(meta_parts) == 1 else torch.cat(meta_parts, dim=1)
    return hidden, meta


def _runs(starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
    """Merge adjacent row ranges, so a batch of tagged requests is one slice."""
    if np.array_equal(starts[1:], ends[:-1]):  # the usual case: every request of the batch is ours
        return [(int(starts[0]), int(ends[-1]))]
    cut = (starts[1:] != ends[:-1]).nonzero()[0] + 1  # a run begins where a chunk does not follow on
    firsts = np.concatenate(([0], cut))
    lasts = np.concatenate((cut - 1, [len(starts) - 1]))
    return list(zip(starts[firsts].tolist(), ends[lasts].tolist()))
