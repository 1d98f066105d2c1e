"""Hugging Face reference for capture points and steering: forward hooks on HF's own modules.

Each point is read where docs/capture_points.md says it is (``attn_in`` = input of
``self_attn``, ``attn_out`` = its output, ``mlp_in`` / ``mlp_out`` = input / output of ``mlp``),
and steering adds ``scale * vector`` at the same place, to positions >= the term's first
position. Residual-stream columns (HF indices) are read from the decoder layers' inputs /
outputs by hooks registered after the steering hooks, so they include the steering.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from reference import hf_model

#: (point, layer, vector, scale, first position)
Term = tuple[str, int, Sequence[float], float, int]


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _replace_first(x, new):
    return (new, *x[1:]) if isinstance(x, tuple) else new


@torch.no_grad()
def hf_point_run(path: str | Path, token_ids: Sequence[int], layers: Sequence[int],
                 points: Sequence[tuple[str, int]] = (), steer: Sequence[Term] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``([T, len(layers) + len(points), H] rows, [T, vocab] logits)`` of HF's fp32 forward on
    ``token_ids`` with the steering terms applied."""
    model = hf_model(str(path))
    blocks = model.model.layers
    T = len(token_ids)
    H = model.config.hidden_size
    deltas: dict[tuple[str, int], torch.Tensor] = {}
    for point, layer, vector, scale, first in steer:
        d = deltas.setdefault((point, layer), torch.zeros(T, H))
        d[first:] += scale * torch.tensor(list(vector), dtype=torch.float32)
    got: dict = {}
    handles = []

    def pre(site, name, index):
        def hook(module, args, kwargs):
            x = kwargs[name] if name in kwargs else args[index]
            if site in deltas:
                x = x + deltas[site].to(x.dtype)
            got[site] = x.detach().clone()
            if name in kwargs:
                return args, {**kwargs, name: x}
            return (*args[:index], x, *args[index + 1:]), kwargs
        return hook

    def post(site):
        def hook(module, args, output):
            x = _first(output)
            if site in deltas:
                x = x + deltas[site].to(x.dtype)
            got[site] = x.detach().clone()
            return _replace_first(output, x)
        return hook

    try:
        for k, block in enumerate(blocks):
            handles.append(block.self_attn.register_forward_pre_hook(pre(("attn_in", k), "hidden_states", 0),
                                                                      with_kwargs=True))
            handles.append(block.self_attn.register_forward_hook(post(("attn_out", k))))
            handles.append(block.mlp.register_forward_pre_hook(pre(("mlp_in", k), "x", 0), with_kwargs=True))
            handles.append(block.mlp.register_forward_hook(post(("mlp_out", k))))
            handles.append(block.register_forward_hook(post(("resid_post", k))))
        handles.append(blocks[0].register_forward_pre_hook(pre(("resid_pre", 0), "hidden_states", 0),
                                                           with_kwargs=True))
        logits = model(torch.tensor([list(token_ids)])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    cols = [got[("resid_pre", 0)] if k == 0 else got[("resid_post", k - 1)] for k in layers]
    cols += [got[site] for site in points]
    return torch.stack([c[0].float() for c in cols], dim=1), logits
