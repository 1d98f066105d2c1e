"""Wire the uncertainty service into a vLLM OpenAI app after vLLM initialised its state.

Configuration travels through vLLM's own ``additional_config``: the capture settings under
``"uhead_vllm"`` (read by the worker extension too) and the server's under ``"uhead_vllm_serve"``
(head directory or "none", byte limits), so plain ``vllm serve`` with the middleware works as well.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..capture.protocol import CAPTURE_KEY, CaptureSettings
from .service import UncertaintyService
from ..adapters.model import residual_streams
from ..adapters.server import (EngineTap, TrustedEngine, end_requests_when_engine_stops, install_child_tags,
                               install_engine_gate)
from .spec import reserved_keys

SERVE_KEY = "uhead_vllm_serve"
DEFAULT_MAX_ROWS_BYTES = 64 << 20
DEFAULT_STORE_BYTES = 256 << 20
#: Rows of S streams per layer: the server's row layout and heads assume one stream.
MULTI_STREAM_REFUSAL = ("uhead_vllm serving does not support models with {streams} residual streams (DeepSeek-V4 "
                        "mHC); capture them with VllmHiddenStatesGenerator (docs/capture_points.md#multi-stream-models)")


def install(state: Any) -> UncertaintyService:
    """Build the service from ``state.vllm_config`` and wrap the chat and completions handlers."""
    existing = getattr(state, "uhead_service", None)
    if existing is not None:
        return existing
    vllm_config = state.vllm_config
    extra = vllm_config.additional_config or {}
    if CAPTURE_KEY not in extra:
        raise RuntimeError(
            "uhead_vllm serving needs capture in the engine: start vLLM with "
            "--worker-extension-cls uhead_vllm.capture.extension.UheadCaptureExtension and "
            "--additional-config '{\"uhead_vllm\": {\"layers\": [...]}}' (or use `uhead-vllm serve`)")
    settings = CaptureSettings.from_dict(extra[CAPTURE_KEY])
    streams = residual_streams(vllm_config)
    if streams > 1:  # `uhead-vllm serve` refuses before vLLM starts; this is for plain `vllm serve`
        raise NotImplementedError(MULTI_STREAM_REFUSAL.format(streams=streams))
    cfg = extra.get(SERVE_KEY, {}) or {}
    if cfg.get("scores_on_device") and not settings.token_inputs:
        raise ValueError("scores_on_device needs the engine's capture settings to carry the head's token inputs: "
                         "leave additional_config['uhead_vllm'] unset (the plugin or `uhead-vllm serve` writes it)")
    engine = state.engine_client
    # Every route's requests meet the gate; the server's own (the tap's, the recompute's) are minted.
    install_engine_gate(engine, reserved_keys)
    end_requests_when_engine_stops(engine)  # running requests must not hold a stopping server open
    scorer = _scorer(cfg, vllm_config.model_config.model, engine.get_tokenizer(), settings)
    # Rows are the model's states, or the head's D inputs where the worker reduces them (--scores-on-device).
    width = scorer.inputs_width if scorer is not None and scorer.reduced else vllm_config.model_config.get_hidden_size()
    service = UncertaintyService(
        TrustedEngine(engine), scorer, settings, width, vllm_config.cache_config.block_size,
        int(cfg.get("max_rows_bytes", DEFAULT_MAX_ROWS_BYTES)), int(cfg.get("store_bytes", DEFAULT_STORE_BYTES)),
        vllm_config.model_config.get_total_num_hidden_layers())
    install_child_tags()
    for attr, method in (("openai_serving_chat", "create_chat_completion"),
                         ("openai_serving_completion", "create_completion")):
        handler = getattr(state, attr, None)
        if handler is not None:
            from .handlers import wrap_handler

            handler.engine_client = EngineTap(handler.engine_client, service.registry, service.watch)
            wrap_handler(handler, method, service)
    state.uhead_service = service
    return service


def _scorer(cfg: dict, model_path: str, tokenizer: Any, settings: CaptureSettings) -> Any:
    import torch

    from ..capture.token_weight import load_weight
    from ..heads import default_head_dir, load_head_for_model
    from .scoring import Scorer

    head_dir = cfg.get("head")
    if head_dir == "none":
        if settings.token_inputs:
            raise ValueError("the engine reduces rows to a head's inputs (token_inputs): serve that head, not --head none")
        return None
    path = Path(head_dir).expanduser() if head_dir else default_head_dir()
    head = load_head_for_model(path, model_path, allow_other_weights=bool(cfg.get("allow_other_weights", False)))
    torch.set_num_threads(int(cfg.get("head_threads", 1)))  # the engine core needs the cores
    name = cfg.get("head_name") or ("default" if path.resolve() == default_head_dir().resolve() else path.name)
    inputs = None
    if settings.token_inputs:  # the worker reduces rows with this file's weight: it must be this head's
        inputs = head.token_inputs()
        layers, weight = load_weight(settings.token_inputs)
        if layers != inputs.layers or not torch.equal(weight, inputs.weight):
            raise ValueError(f"token_inputs {settings.token_inputs} is not the served head's ({path}): start the "
                             "server with --scores-on-device, which writes the head's own")
    return Scorer(head, name, tokenizer, settings.layers, inputs)
