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
from .protocol import CAPTURE_KEY, CaptureSettings, encode_rows
from .recorder import RowRecorder

_STATE_ATTR = "_uhead_recorder"


def _install(runner: Any) -> None:
    cfg = vi.additional_config(runner).get(CAPTURE_KEY)
    if cfg is None:
        return
    settings = CaptureSettings.from_dict(cfg)
    model = runner.model
    n_layers = vi.decoder_num_layers(model)
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
    if not vi.supports_aux_layers(model):
        raise NotImplementedError(
            f"{type(model).__name__} does not implement vLLM's aux hidden-state interface "
            "(SupportsEagle3); hidden-state capture is not available for this architecture"
        )
    if vi.tp_rank() != 0:
        return  # the residual stream is replicated across TP ranks: rank 0 alone records
    aux_layers = tuple(sorted(settings.layers))
    vi.set_aux_layers(model, aux_layers)
    recorder = RowRecorder(settings=settings, aux_layers=aux_layers, hidden_size=vi.hidden_size(runner))
    setattr(runner, _STATE_ATTR, recorder)

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
                           "aux_layers": list(rec.aux_layers), "hidden_size": rec.hidden_size,
                           "bytes_held": rec.bytes_held, "error": rec.error,
                           "vllm_checked": vi.CHECKED_VLLM_VERSION})
