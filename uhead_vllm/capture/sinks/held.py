"""Rows kept in the worker until the engine side takes them (no destination).

Each step's rows are gathered into new tensors and, on a GPU, copied asynchronously into pinned
memory of their own on the side stream (cuda_streams.py); a take waits once and assembles one
:class:`CapturedRows`, the hidden rows left as one part per step. A server's concurrent requests
each take their own tags (:meth:`HeldRows.take_tags`).

A tag take never waits for a forward. The engine core serves it between steps while, with async
scheduling, the next step already runs on the device; waiting for that step's rows stalled the
engine once per take (the device idles while the host catches up). No caller needs them: a server
asks for rows of tokens it has seen, and vLLM emits a step's tokens only after its forward. So a
tag take waits only for the copies of forwards that are done (each step's ``computed`` event, on
the main stream after its gathers) and leaves later steps held for the next take.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

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
    computed: Any = None  # GPU: event after the forward's gathers (main stream); None: on the host
    copied: Any = None  # GPU: event after the copy to ``hidden``/``meta`` (side stream)
    dropped: frozenset[int] = frozenset()  # tags forgotten while the step ran: cut at its take

    def forward_done(self) -> bool:
        return self.computed is None or bool(self.computed.query())

    def without(self, tags: np.ndarray) -> "_Step | None":
        """The step less the chunks of ``tags`` (None: nothing left); its rows must be on the host."""
        hit = np.isin(self.tags, tags)
        if not hit.any():
            return self
        if hit.all():
            return None
        return self.part(~hit)

    def part(self, chunk_hit: np.ndarray) -> "_Step":
        """The chunks ``chunk_hit`` of the step (host rows)."""
        row_hit = torch.from_numpy(np.repeat(chunk_hit, self.lens))
        return _Step(self.tags[chunk_hit], self.samples[chunk_hit], self.lens[chunk_hit],
                     self.hidden[row_hit], self.meta[:, row_hit])


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
        computed = copied = None
        if hidden.device.type == "cuda":  # on CPU already new tensors (stack/cat copies), never engine buffers
            computed = torch.cuda.Event()
            computed.record(torch.cuda.current_stream(hidden.device))
            host_meta = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True)
            host_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
            copied = self.copies.copy_to_host([(host_hidden, hidden), (host_meta, meta)])
            hidden, meta = host_hidden, host_meta
        self.steps.append(_Step(layout.tags, layout.samples, layout.lens, hidden, meta, computed, copied))
        self.bytes_held += layout.n_rows * self.settings.num_columns * self.hidden_size * dtype.itemsize

    def discard(self) -> None:
        self.steps.clear()
        self.bytes_held = 0

    def take(self) -> CapturedRows:
        self.copies.synchronize()
        rows = self._rows([k for k in (self._settled(s) for s in self.steps) if k is not None])
        rows.stats = {"forwards_replayed": 0, "place_seconds": 0.0, "rows_written_on_device": 0}
        self.steps = []
        self.bytes_held = 0
        return rows

    def take_tags(self, tags: list[int], forget: bool = False) -> CapturedRows:
        """Only the rows of ``tags`` from the forwards done so far; the rows of other tags stay,
        and so do the steps whose forward still runs (module docstring). ``forget``: the tags'
        rows in those steps are dropped when they are done, so nothing of theirs is left."""
        wanted = np.asarray(sorted(set(int(t) for t in tags)), dtype=np.int64)
        done = 0
        while done < len(self.steps) and self.steps[done].forward_done():
            done += 1
        if done and self.steps[done - 1].copied is not None:
            self.steps[done - 1].copied.synchronize()  # copies finish in order (one side stream)
        taken: list[_Step] = []
        kept: list[_Step] = []
        for step in self.steps[:done]:
            s = self._settled(step)
            if s is None:
                continue
            chunk_hit = np.isin(s.tags, wanted)
            if not chunk_hit.any():
                kept.append(s)
            elif chunk_hit.all():
                taken.append(s)
            else:
                taken.append(s.part(chunk_hit))
                kept.append(s.part(~chunk_hit))
        running = self.steps[done:]
        if forget:
            forgotten = frozenset(wanted.tolist())
            running = [replace(s, dropped=s.dropped | forgotten) for s in running]
        self.steps = kept + running
        self.bytes_held = sum(s.hidden.numel() * s.hidden.element_size() for s in self.steps)
        return self._rows(taken)

    def settle(self) -> None:
        """Cut forgotten tags' rows out of the steps whose copies are done (no waiting): what
        ``bytes_held`` reports once a server is idle."""
        steps = [self._settled(s) if s.dropped and (s.copied is None or s.copied.query()) else s
                 for s in self.steps]
        self.steps = [s for s in steps if s is not None]
        self.bytes_held = sum(s.hidden.numel() * s.hidden.element_size() for s in self.steps)

    @staticmethod
    def _settled(s: _Step) -> _Step | None:
        """``s`` less the rows of the tags forgotten while it ran (its copy must be done)."""
        if not s.dropped:
            return s
        left = s.without(np.asarray(sorted(s.dropped), dtype=np.int64))
        return None if left is None else replace(left, dropped=frozenset())

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
