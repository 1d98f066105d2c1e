"""Eager-mode hooks at the points inside decoder layers (see :mod:`.points`): read and steer.

One hook per (point, layer) does both, in this order: add the step's steering delta for that
site (if any request steers there), then copy the value if the site is captured, so capture
sees the steered stream. Values are copied at once: vLLM's fused add + RMSNorm overwrites
``self_attn``'s output in place with the next norm's output, and the next layer's input norm
does the same to ``mlp``'s output.

- ``attn_in`` / ``mlp_in``: forward pre-hooks on ``self_attn`` / ``mlp`` (their input).
- ``attn_out`` / ``mlp_out``: forward hooks on ``self_attn`` / ``mlp`` (their output).
- ``resid_post``: forward hook on the decoder layer, adding to the ``residual`` it returns
  (vLLM's stream after the layer is ``hidden + residual``), steering only.

Hooks on compiled submodules never fire, so ``extension.py`` refuses these in compiled mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .points import SUBLAYER_POINTS, Site


@dataclass
class SublayerState:
    """What the hooks read and write during the forward that is running now."""

    recording: bool = False
    deltas: dict[Site, torch.Tensor] = field(default_factory=dict)  # [T, H] per steered site
    captured: dict[Site, torch.Tensor] = field(default_factory=dict)

    def reset(self) -> None:
        self.recording = False
        self.deltas = {}
        self.captured = {}


def install_sublayer_hooks(sublayers: list[tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]],
                           capture: tuple[Site, ...], steer: bool, state: SublayerState) -> list[Any]:
    """Hook the sites of ``capture`` (and, with ``steer``, every steerable site) of ``sublayers``
    (``(layer, self_attn, mlp)`` per decoder layer). Returns the hook handles."""
    captured = set(capture)
    sites = {(p, k) for p in SUBLAYER_POINTS for k in range(len(sublayers))} if steer else set(captured)
    bad = sorted(s for s in sites if s[1] >= len(sublayers))
    if bad:
        raise ValueError(f"capture points {bad} out of range: the model has {len(sublayers)} decoder "
                         f"layers (0..{len(sublayers) - 1})")
    handles = []
    for point, k in sorted(sites):
        layer, attn, mlp = sublayers[k]
        module = attn if point.startswith("attn") else mlp
        if point.endswith("_in"):
            name, index = ("hidden_states", 1) if point == "attn_in" else ("x", 0)
            handles.append(module.register_forward_pre_hook(
                _input_hook(state, (point, k), (point, k) in captured, name, index), with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(_output_hook(state, (point, k), (point, k) in captured)))
    if steer:
        for k, (layer, _, _) in enumerate(sublayers):
            handles.append(layer.register_forward_hook(_residual_hook(state, ("resid_post", k))))
    return handles


def _apply(state: SublayerState, site: Site, x: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """x plus the site's delta (None when unchanged); a copy of the result kept when recording."""
    delta = state.deltas.get(site)
    out = None if delta is None else x + delta.to(x.dtype)
    if keep and state.recording:
        state.captured[site] = (x if out is None else out).detach().clone()
    return out


def _input_hook(state: SublayerState, site: Site, keep: bool, name: str, index: int) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            new = _apply(state, site, kwargs[name], keep)
            return None if new is None else (args, {**kwargs, name: new})
        if len(args) <= index:  # called with another keyword: the point cannot be read here
            raise TypeError(f"{type(module).__name__} called without its input ({name!r} or argument {index})")
        new = _apply(state, site, args[index], keep)
        return None if new is None else ((*args[:index], new, *args[index + 1:]), kwargs)
    return hook


def _output_hook(state: SublayerState, site: Site, keep: bool) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(module).__name__} returned {type(output).__name__}, not one tensor")
        return _apply(state, site, output, keep)
    return hook


def _residual_hook(state: SublayerState, site: Site) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        delta = state.deltas.get(site)
        if delta is None:
            return None
        hidden, residual = output
        return hidden, (hidden.new_zeros(()) if residual is None else residual) + delta.to(hidden.dtype)
    return hook


__all__ = ["SublayerState", "install_sublayer_hooks"]
