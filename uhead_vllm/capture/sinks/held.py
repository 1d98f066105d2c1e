"""Rows kept in the worker until the engine side takes them (no destination).

Each step's rows are gathered into new tensors and, on a GPU, copied asynchronously into pinned
memory of their own on the side stream (cuda_streams.py); a take waits once and assembles one
:class:`CapturedRows`, the hidden rows left as one part per step. A server's concurrent requests
each take their own tags (:meth:`HeldRows.take_tags`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..cuda_streams import CopyStream
from ..protocol import CapturedRows, CaptureSettings, empty_rows
from ..step_layout import StepLayout, gathered


@dataclass
class _Step:
    tags: np.ndarray  # [C] per chunk (one chunk per tagged request in the step)
    samples: np.ndarray  # [C]
    lens: np.ndarray  # [C] rows per chunk
    hidden: torch.Tensor  # [R, L, H] host (pinned when the step ran on a GPU)
    meta: torch.Tensor  # [2, R] int64 host: positions, input token ids


class HeldRows:
    """The steps recorded since the last take, on the host."""

    def __init__(self, settings: CaptureSettings, hidden_size: int, copies: CopyStream) -> None:
        self.settings, self.hidden_size, self.copies = settings, hidden_size, copies
        self.steps: list[_Step] = []
        self.bytes_held = 0

    def holds_rows(self) -> bool:
        return bool(self.steps)

    def record(self, layout: StepLayout, picked: list[torch.Tensor], positions: torch.Tensor,
               input_ids: torch.Tensor) -> None:
        dtype = self.settings.torch_dtype
        hidden, meta = gathered(picked, positions, input_ids, layout.runs, dtype)
        if hidden.device.type == "cuda":  # on CPU already new tensors (stack/cat copies), never engine buffers
            host_meta = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True)
            host_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
            self.copies.copy_to_host([(host_hidden, hidden), (host_meta, meta)])
            hidden, meta = host_hidden, host_meta
        self.steps.append(_Step(layout.tags, layout.samples, layout.lens, hidden, meta))
        self.bytes_held += layout.n_rows * self.settings.num_columns * self.hidden_size * dtype.itemsize

    def discard(self) -> None:
        self.steps.clear()
        self.bytes_held = 0

    def take(self) -> CapturedRows:
        self.copies.synchronize()
        rows = self._rows(self.steps)
        rows.stats = {"forwards_replayed": 0, "place_seconds": 0.0, "rows_written_on_device": 0}
        self.steps = []
        self.bytes_held = 0
        return rows

    def take_tags(self, tags: list[int]) -> CapturedRows:
        """Only the rows of ``tags``; the rows of other tags stay."""
        self.copies.synchronize()
        wanted = np.asarray(sorted(set(int(t) for t in tags)), dtype=np.int64)
        taken: list[_Step] = []
        kept: list[_Step] = []
        for s in self.steps:
            chunk_hit = np.isin(s.tags, wanted)
            if not chunk_hit.any():
                kept.append(s)
                continue
            if chunk_hit.all():
                taken.append(s)
                continue
            row_hit = torch.from_numpy(np.repeat(chunk_hit, s.lens))
            taken.append(_Step(s.tags[chunk_hit], s.samples[chunk_hit], s.lens[chunk_hit],
                               s.hidden[row_hit], s.meta[:, row_hit]))
            kept.append(_Step(s.tags[~chunk_hit], s.samples[~chunk_hit], s.lens[~chunk_hit],
                              s.hidden[~row_hit], s.meta[:, ~row_hit]))
        self.steps = kept
        self.bytes_held = sum(s.hidden.numel() * s.hidden.element_size() for s in kept)
        return self._rows(taken)

    def _rows(self, steps: list[_Step]) -> CapturedRows:
        """The steps' rows as one :class:`CapturedRows`, the hidden rows left as one part per step."""
        layers = tuple(self.settings.layers)
        if not steps:
            return empty_rows(layers, self.hidden_size, self.settings.torch_dtype, self.settings.num_columns)
        lens = torch.from_numpy(np.concatenate([s.lens for s in steps]))
        meta = torch.cat([s.meta for s in steps], dim=1)
        return CapturedRows(
            layers=layers,
            hidden_parts=[s.hidden for s in steps],
            tags=torch.repeat_interleave(torch.from_numpy(np.concatenate([s.tags for s in steps])), lens),
            samples=torch.repeat_interleave(torch.from_numpy(np.concatenate([s.samples for s in steps])), lens),
            positions=meta[0].contiguous(),
            token_ids=meta[1].contiguous(),
            chunk_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
        )
