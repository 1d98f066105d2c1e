"""Eager-mode capture route: forward hooks on decoder layers, for models without aux outputs.

Models that do not implement vLLM's aux hidden-state interface (most hybrid attention +
state-space models) are read with hooks instead: a pre-hook on decoder layer 0 gives HF index 0
(its input stream), a forward hook on layer k-1 gives index k (its output, read with the
architecture's :class:`~.architectures.StreamRule`). Hooks on compiled submodules never fire, so
this route exists only in eager mode; ``extension.py`` refuses compiled engines for it.

A pre-hook on the top-level model decides once per forward whether any tagged request is in the
batch; when none is, the layer hooks return at once and nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .architectures import StreamRule, stream_from_input, stream_from_output


@dataclass
class _Forward:
    """Streams collected during the forward that is running now."""

    active: bool = False
    streams: dict[int, torch.Tensor] = field(default_factory=dict)


def install_layer_hooks(
    model: torch.nn.Module,
    layers: torch.nn.ModuleList,
    rule: StreamRule,
    aux_layers: tuple[int, ...],
    begin: Callable[[dict], bool],
    finish: Callable[[dict, list[torch.Tensor]], None],
    fail: Callable[[str], None],
) -> list[Any]:
    """Hook ``model`` so each forward hands ``finish(kwargs, streams)`` the HF-indexed streams.

    ``aux_layers`` are HF indices in 0..len(layers); ``streams`` follows their order.
    ``begin(kwargs)`` runs before the forward and says whether this forward is recorded;
    ``fail(message)`` is called instead of ``finish`` when a hook did not fire or a layer's output
    does not fit ``rule`` (never partial rows; the engine keeps serving).
    Returns the hook handles.
    """
    n = len(layers)
    bad = [k for k in aux_layers if not 0 <= k <= n]
    if bad:
        raise ValueError(f"layer indices {bad} out of range 0..{n}")
    state = _Forward()
    handles = []

    def on_model_pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        state.streams = {}
        state.active = bool(begin(kwargs))

    def on_model_post(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not state.active:
            return
        state.active = False
        missing = [k for k in aux_layers if k not in state.streams]
        if missing:
            state.streams = {}
            fail(f"layer hooks did not fire for HF indices {missing} (a layer was skipped or "
                 "compiled): no rows were recorded for this forward")
            return
        streams = [state.streams.pop(k) for k in aux_layers]
        finish(kwargs, streams)

    def _keep(k: int, read: Callable[[], torch.Tensor]) -> None:
        try:
            # Copy now: later layers may update the tensors they are handed in place.
            state.streams[k] = read().detach().clone()
        except TypeError as exc:  # the table does not match this vLLM build: report, keep serving
            state.active = False
            state.streams = {}
            fail(f"cannot read HF index {k} with stream rule {rule.value!r}: {exc}")

    handles.append(model.register_forward_pre_hook(on_model_pre, with_kwargs=True))
    handles.append(model.register_forward_hook(on_model_post, with_kwargs=True))

    if 0 in aux_layers:
        def on_first_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if state.active:
                _keep(0, lambda: stream_from_input(rule, args, kwargs))

        handles.append(layers[0].register_forward_pre_hook(on_first_input, with_kwargs=True))

    for k in aux_layers:
        if k == 0:
            continue

        def on_output(module: torch.nn.Module, args: tuple, output: Any, k: int = k) -> None:
            if state.active:
                _keep(k, lambda: stream_from_output(rule, output))

        handles.append(layers[k - 1].register_forward_hook(on_output))
    return handles
