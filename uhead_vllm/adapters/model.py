"""Model-level and process-level vLLM internals the capture side reads (both runners).

- ``EagleModelMixin.set_aux_hidden_state_layers``: the decoder then returns ``(hidden, [aux...])``
  where aux k is ``hidden + residual`` after decoder layer k-1 (k = 0: the embeddings), i.e.
  Hugging Face's ``hidden_states[k]`` with the last index taken before the final norm.
- Layer 0's aux entry *is* the embedding tensor; in eager mode the first decoder layer's fused
  add + RMSNorm updates that tensor in place on GPU before the forward returns. Compiled graphs
  functionalise the update; eager mode needs :func:`protect_embedding_output`.
"""

from __future__ import annotations

from typing import Any

import torch


def additional_config(runner: Any) -> dict:
    cfg = runner.vllm_config.additional_config
    return cfg if isinstance(cfg, dict) else {}


def uses_aux_outputs_already(runner: Any) -> bool:
    """True when vLLM itself consumes aux hidden states (EAGLE-3, extract_hidden_states)."""
    return bool(getattr(runner, "use_aux_hidden_state_outputs", False))


def language_model(model: torch.nn.Module) -> Any:
    holder = model.get_language_model() if hasattr(model, "get_language_model") else model
    return getattr(holder, "model", holder)


def decoder_num_layers(model: torch.nn.Module) -> int:
    """Number of decoder layers of the loaded (possibly multimodal-wrapped) language model."""
    holder = language_model(model)
    if not hasattr(holder, "layers"):
        raise RuntimeError(f"{type(model).__name__}: no decoder layers found at .model.layers")
    return len(holder.layers)


def supports_aux_layers(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "set_aux_hidden_state_layers", None))


def protect_embedding_output(model: torch.nn.Module) -> Any:
    """Eager mode: hand the first decoder layer a copy of its input stream, so the embedding
    tensor that vLLM keeps as aux output 0 is not overwritten in place. Returns the hook handle."""
    first = language_model(model).layers[0]

    def copy_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if len(args) >= 2 and isinstance(args[1], torch.Tensor):
            return (args[0], args[1].clone(), *args[2:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"].clone()}
        return None

    return first.register_forward_pre_hook(copy_input, with_kwargs=True)


def hidden_size(runner: Any) -> int:
    return int(runner.model_config.get_hidden_size())


def device_of(runner: Any) -> torch.device:
    return torch.device(runner.device)


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def tp_world_size() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

    return int(get_tensor_model_parallel_world_size())


def pp_world_size() -> int:
    from vllm.distributed.parallel_state import get_pp_group

    return int(get_pp_group().world_size)


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


def decoder_sublayers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]]:
    """``(layer, self_attn, mlp)`` of every decoder layer of a plain (Llama / Qwen3 style)
    decoder; ``NotImplementedError`` naming what is missing for any other layout."""
    holder = language_model(model)
    layers = getattr(holder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise NotImplementedError(f"{type(model).__name__}: no decoder layers at .model.layers")
    out = []
    for k, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not isinstance(attn, torch.nn.Module) or not isinstance(mlp, torch.nn.Module):
            raise NotImplementedError(
                f"{type(model).__name__} decoder layer {k} ({type(layer).__name__}) has no self_attn and mlp "
                "submodules, so the points inside it (attn_in, attn_out, mlp_in, mlp_out) are not defined")
        out.append((layer, attn, mlp))
    return out


def residual_streams(holder: Any) -> int:
    """How many parallel residual streams the model keeps (DeepSeek-V4 mHC: ``hc_mult``, else 1);
    ``holder`` is anything with vLLM's ``model_config``: a model runner or a ``VllmConfig``."""
    return int(getattr(holder.model_config.hf_text_config, "hc_mult", 1) or 1)
