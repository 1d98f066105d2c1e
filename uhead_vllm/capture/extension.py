"""Worker extension: installs capture when the model loads and answers the engine's RPCs.

Pass ``worker_extension_cls=EXTENSION_QUALNAME`` and ``additional_config={CAPTURE_KEY: settings}``
to ``vllm.LLM`` (``uhead_vllm.capture_engine_kwargs`` builds both). Importing this module (vLLM does
so in every worker before loading the model) installs the after-load hook; the hook does nothing
for engines whose ``additional_config`` lacks our key.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from . import vllm_internals as vi
from .architectures import ARCHITECTURES, EngineDefectError, engine_setting_problem, spec_for
from .layer_hooks import install_layer_hooks
from .protocol import CAPTURE_KEY, CaptureSettings, encode_rows
from .recorder import RowRecorder

_STATE_ATTR = "_uhead_recorder"
_ROUTE_ATTR = "_uhead_route"


def _install(runner: Any) -> None:
    cfg = vi.additional_config(runner).get(CAPTURE_KEY)
    if cfg is None:
        return
    settings = CaptureSettings.from_dict(cfg)
    model = runner.model
    arch = vi.model_architecture(model)
    spec = ARCHITECTURES.get(arch)
    if spec is not None and spec.engine_defect:
        raise EngineDefectError(f"capture refused for {arch}: {spec.engine_defect}")
    use_aux = vi.supports_aux_layers(model)
    if use_aux:
        n_layers = vi.decoder_num_layers(model)
    else:
        spec = spec_for(arch)  # clear error for an architecture we cannot read
        layers = vi.decoder_layers(model, spec.layers_path)
        n_layers = len(layers)
    bad = [k for k in settings.layers if k > n_layers]
    if bad:
        raise ValueError(
            f"capture layers {bad} out of range: this model has {n_layers} decoder layers, so valid "
            f"Hugging Face hidden-state indices are 0..{n_layers} (0 = embeddings, {n_layers} = "
            "after the last layer, before the final norm)"
        )
    if vi.pp_world_size() > 1:
        raise NotImplementedError(
            "uhead_vllm capture does not support pipeline parallelism yet: each rank holds only a "
            "slice of the layers and partial rows would be returned. Use tensor parallelism or one "
            "worker."
        )
    if vi.uses_aux_outputs_already(runner):
        raise NotImplementedError(
            "uhead_vllm capture cannot share aux hidden states with EAGLE-3 / extract_hidden_states "
            "speculative decoding; use the 'extract' backend or a model-free method such as ngram"
        )
    problem = engine_setting_problem(
        vi.state_space_types(model), vi.prefix_caching_enabled(runner), vi.running_on_cpu(),
        layer_hooks=not use_aux, tp_size=vi.tp_world_size(), speculative=vi.speculative_method(runner),
    )
    if problem:
        raise NotImplementedError(f"uhead_vllm capture for {arch}: {problem}")
    if not use_aux and not vi.is_eager(runner):
        raise NotImplementedError(
            f"{arch} has no aux hidden-state interface, so uhead_vllm reads it with forward hooks "
            "on its decoder layers, and hooks on compiled submodules never fire. Build the engine "
            "with enforce_eager=True"
        )
    if vi.tp_rank() != 0:
        return  # the residual stream is replicated across TP ranks: rank 0 alone records
    aux_layers = tuple(sorted(settings.layers))
    recorder = RowRecorder(settings=settings, aux_layers=aux_layers, hidden_size=vi.hidden_size(runner))
    setattr(runner, _STATE_ATTR, recorder)
    setattr(runner, _ROUTE_ATTR, "aux" if use_aux else "layer_hooks")
    if use_aux:
        _install_aux(runner, model, recorder, aux_layers)
    else:
        _install_hooks(runner, model, layers, spec.stream, recorder, aux_layers)


def _install_aux(runner: Any, model: torch.nn.Module, recorder: RowRecorder,
                 aux_layers: tuple[int, ...]) -> None:
    """Compile-safe route: the model itself returns the aux streams next to its output."""
    vi.set_aux_layers(model, aux_layers)

    def on_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not isinstance(output, tuple):
            return output  # intermediate PP output or a dummy run without aux
        hidden, aux = output
        positions = kwargs.get("positions")
        input_ids = kwargs.get("input_ids")
        if positions is not None and input_ids is not None:
            req_ids, qsl = vi.batch_layout(runner)
            tags = [recorder.tag_of(r, vi.request_extra_args(runner, r)) for r in req_ids]
            recorder.record(req_ids, qsl, tags, positions, input_ids, aux)
        return hidden

    model.register_forward_hook(on_forward, with_kwargs=True)


def _install_hooks(runner: Any, model: torch.nn.Module, layers: torch.nn.ModuleList, rule: Any,
                   recorder: RowRecorder, aux_layers: tuple[int, ...]) -> None:
    """Eager-only route: hooks on the decoder layers (see layer_hooks.py)."""
    batch: dict[str, Any] = {}

    def begin(kwargs: dict) -> bool:
        positions, input_ids = kwargs.get("positions"), kwargs.get("input_ids")
        if positions is None or input_ids is None:
            return False
        req_ids, qsl = vi.batch_layout(runner)
        tags = [recorder.tag_of(r, vi.request_extra_args(runner, r)) for r in req_ids]
        batch.update(req_ids=req_ids, qsl=qsl, tags=tags)
        if recorder.error is not None or not any(t is not None for t in tags):
            recorder.record(req_ids, qsl, tags, positions, input_ids, [])  # counts the forward
            return False
        return True

    def finish(kwargs: dict, streams: list[torch.Tensor]) -> None:
        recorder.record(batch["req_ids"], batch["qsl"], batch["tags"], kwargs["positions"],
                        kwargs["input_ids"], streams)

    def fail(message: str) -> None:
        if recorder.error is None:
            recorder.error = message

    install_layer_hooks(model, layers, rule, aux_layers, begin, finish, fail)


vi.install_after_load_hook(_install)


class UheadCaptureExtension:
    """Methods vLLM mixes into its worker; called with ``llm.collective_rpc("uhead_...")``."""

    def _uhead_get_recorder(self) -> RowRecorder | None:
        return getattr(self.model_runner, _STATE_ATTR, None)

    def uhead_fetch(self) -> bytes | None:
        """All rows recorded since the last fetch as safetensors bytes (None on non-recording ranks)."""
        rec = self._uhead_get_recorder()
        if rec is None:
            return None
        return encode_rows(rec.take(vi.live_request_ids(self.model_runner)))

    def uhead_status(self) -> str:
        """JSON: whether this rank records, its settings and what it holds now."""
        rec = self._uhead_get_recorder()
        if rec is None:
            return json.dumps({"recording": False})
        return json.dumps({"recording": True, "settings": rec.settings.to_dict(),
                           "aux_layers": list(rec.aux_layers),
                           "route": getattr(self.model_runner, _ROUTE_ATTR, None), "hidden_size": rec.hidden_size,
                           "bytes_held": rec.bytes_held, "error": rec.error,
                           "vllm_checked": vi.CHECKED_VLLM_VERSION})
