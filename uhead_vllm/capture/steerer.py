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
                self._requests[rid] = _Steered(n, [
                    ((t.point, t.layer), t.first_position(n),
                     t.scale * torch.tensor(t.vector, dtype=torch.float32)) for t in spec.terms])

    def deltas(self, step: StepOutputs, dtype: torch.dtype, device: torch.device) -> dict[Site, torch.Tensor]:
        """This forward's ``[T, H]`` delta per steered site (empty when no request steers)."""
        out: dict[Site, torch.Tensor] = {}
        if not self._requests:
            return out
        qsl = step.query_start_loc
        positions = step.positions[0] if step.positions.dim() > 1 else step.positions
        for i, rid in enumerate(step.req_ids):
            req = self._requests.get(rid)
            a, b = int(qsl[i]), int(qsl[i + 1])
            if req is None or b <= a:
                continue
            pos = positions[a:b].cpu()
            for site, first, vector in req.terms:
                rows = torch.nonzero(pos >= first).flatten() + a
                if rows.numel() == 0:
                    continue
                delta = out.get(site)
                if delta is None:
                    delta = out[site] = torch.zeros(positions.shape[0], self.hidden_size, dtype=torch.float32)
                delta[rows] += vector
        return {site: d.to(device=device, dtype=dtype) for site, d in out.items()}


__all__ = ["Steerer"]
