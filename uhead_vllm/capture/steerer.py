"""Worker side of steering: which request steers how, and one delta tensor per site per step.

The runner adapter tells us each step's new requests (with their ``extra_args`` and prompt
length) and, right before the forward, the batch layout (request order, token offsets,
positions). From those the steerer builds, for every steered site, one ``[tokens, hidden]``
delta holding ``scale * vector`` on the rows of the requests (and positions) that steer there and
zeros elsewhere; the hooks of :mod:`.sublayer_hooks` add it. Requests in one batch may steer
differently or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..adapters import ScheduledStep, StepOutputs
from .points import Site
from .steering import SteerSpec, SteerSpecError


@dataclass
class _Steered:
    prompt_len: int
    terms: list[tuple[Site, int, torch.Tensor]]  # (site, first position, scale * vector in fp32)


@dataclass
class Steerer:
    """Per-request steering state of one worker."""

    num_layers: int
    hidden_size: int
    fail: Callable[[str], None]  # report a bad spec (the request then runs unsteered; the caller is told)
    _requests: dict[str, _Steered] = field(default_factory=dict)

    def on_schedule(self, step: ScheduledStep) -> None:
        for rid in step.finished_req_ids:
            self._requests.pop(rid, None)
        for rid, extra_args in step.new_requests:
            try:
                spec = SteerSpec.from_extra_args(extra_args)
                if spec is not None:
                    spec.check(self.num_layers, self.hidden_size)
            except SteerSpecError as exc:
                self.fail(f"request {rid}: {exc}")
                continue
            if spec is not None:
                n = step.prompt_lens.get(rid, 0)
                merged: dict[tuple[Site, int], torch.Tensor] = {}  # terms at one site from one position add up
                for t in spec.terms:
                    key = ((t.point, t.layer), t.first_position(n))
                    v = t.scale * torch.tensor(t.vector, dtype=torch.float32)
                    merged[key] = merged[key] + v if key in merged else v
                self._requests[rid] = _Steered(n, [(site, first, v) for (site, first), v in merged.items()])

    def deltas(self, step: StepOutputs, dtype: torch.dtype, device: torch.device) -> dict[Site, torch.Tensor]:
        """This forward's ``[T, H]`` delta per steered site (empty when no request steers).

        Host bookkeeping is numpy slices per request; each site then costs one gather of its
        vectors and one multiply, so a batch of many steered requests stays cheap per step.
        """
        if not self._requests:
            return {}
        qsl = step.query_start_loc
        positions = step.positions[0] if step.positions.dim() > 1 else step.positions
        T = positions.shape[0]
        planes: dict[tuple[Site, int], tuple[np.ndarray, np.ndarray, list[torch.Tensor]]] = {}
        for i, rid in enumerate(step.req_ids):
            req = self._requests.get(rid)
            a, b = int(qsl[i]), int(qsl[i + 1])
            if req is None or b <= a:
                continue
            seen: dict[Site, int] = {}
            for site, first, vector in req.terms:
                j = seen[site] = seen.get(site, -1) + 1  # a second term at a site (other first position)
                plane = planes.get((site, j))
                if plane is None:
                    plane = planes[(site, j)] = (np.full(T, _NEVER, dtype=np.int64), np.zeros(T, dtype=np.int64), [])
                plane[0][a:b] = first
                plane[1][a:b] = len(plane[2])
                plane[2].append(vector)
        if not planes:
            return {}
        pos = positions.cpu().numpy()
        out: dict[Site, torch.Tensor] = {}
        for (site, _), (firsts, index, vectors) in planes.items():
            on = torch.from_numpy(pos >= firsts).unsqueeze(1)
            delta = torch.stack(vectors)[torch.from_numpy(index)] * on
            out[site] = delta if site not in out else out[site] + delta
        return {site: d.to(device=device, dtype=dtype) for site, d in out.items()}


#: "never steered" as a first position
_NEVER = np.iinfo(np.int64).max


__all__ = ["Steerer"]
