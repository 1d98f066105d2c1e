"""Tiny random DeepSeek-V4 folders (mHC: ``hc_mult`` parallel residual streams per token).

Not part of the library's API (hence the leading underscore). ``tests/test_multistream.py`` builds
one for the CPU tests; :data:`GPU_LAYER_TYPES` describes the GPU variant (with the carried tokenizer
and only sliding-window layers). Importing this
module needs neither pytest nor vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STREAMS = 4
LAYERS = 3
HIDDEN = 128
N_EXPERTS = 4

#: The CPU tests' layers: sliding window, CSA (compressor + indexer), HCA (compressor only).
TEST_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
#: The GPU probe's layers. CUDA vLLM 0.26 runs the compressor of a 512-wide head only through a
#: CuTe-DSL kernel (``nvidia-cutlass-dsl`` + ``quack``, not carried) and the CSA indexer only
#: through DeepGEMM, so the probe keeps to sliding-window layers.
GPU_LAYER_TYPES = ("sliding_attention",) * LAYERS
#: HF layer type -> the ``compress_ratios`` entry vLLM reads (0: sliding window only).
COMPRESS_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
#: Longest position (the engine's ``max_model_len`` must not exceed it).
MAX_POSITIONS = 1024
#: RoPE scaling as DeepSeek-V4's released ``config.json`` writes it (legacy ``type`` key; there
#: ``factor`` 16 over 65536 positions), with ``factor`` 1: YaRN then changes no frequency and no
#: scale, so HF (YaRN on the compressed branches only, plain RoPE on the rest) and vLLM (YaRN on every
#: layer, which is the only RoPE its DeepSeek-V4 attention takes: a float32 cos/sin cache over the
#: trailing ``qk_rope_head_dim`` channels, vLLM's ``DeepseekV4ScalingRotaryEmbedding``) rotate alike.
#: vLLM sizes that cache ``original_max_position_embeddings * factor``.
ROPE_SCALING = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": MAX_POSITIONS,
                "beta_fast": 32, "beta_slow": 1}


def build_tiny_deepseek_v4(out: Path, seed: int = 0, *, tokenizer: Any = None,
                           layer_types: tuple[str, ...] = TEST_LAYER_TYPES,
                           round_to_bf16: bool = False, decisive_routing: bool = False) -> Any:
    """Tiny random DeepSeek-V4 folder (4 streams; hash-routed MoE in layer 0; one layer per entry
    of ``layer_types``, by default sliding window, CSA with indexer, HCA) in DeepSeek's native
    checkpoint format; returns the HF model (float32, eval mode).

    ``tokenizer``: saved with the model, its length is the vocabulary (default: the tiny BPE
    tokenizer of :mod:`uhead_vllm._testing`). ``round_to_bf16``: every weight made exactly
    representable in bfloat16, so an engine running in bf16 holds the very weights of the float32
    reference. ``decisive_routing``: each score-routed MoE layer's correction bias lifts a fixed
    (random) pair of experts far above the rest, so vLLM (bf16, fp8 KV) and a float32 reference
    never choose different experts for a token on a near-tie (one other choice moves that token's
    streams by up to ~80%, and attention carries it into later tokens); the routing weights stay
    the unbiased gate scores.

    vLLM constraints: ``head_dim`` 512 with a 64-dim rope part as released (vLLM's attention
    kernels hard-code both); the legacy config keys ``compress_ratios`` / ``num_hash_layers`` /
    ``topk_method`` (vLLM's config class reads them; HF folds them into ``layer_types`` /
    ``mlp_layer_types``, whose values vLLM's base-config validation rejects, so those two are left
    out); ``index_topk`` above every prompt's number of compressed entries (no top-k selection, so
    no discrete choice can differ); RoPE as a released ``config.json`` writes it, a flat legacy
    ``rope_scaling`` (see :data:`ROPE_SCALING`) instead of transformers' ``rope_parameters`` nested by
    ``main`` / ``compress``: vLLM's config class takes that dict whole and hands it to ``get_rope``,
    which fails on the nested dicts (``unhashable type: 'dict'``). Weights are scaled so each layer
    changes the streams substantially (64-113% on average with the test layers) and the streams
    differ from each other."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, GenerationConfig

    if tokenizer is None:
        from ._testing import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
    tok = tokenizer
    layers = len(layer_types)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    cfg = DeepseekV4Config(
        vocab_size=len(tok), hidden_size=HIDDEN, moe_intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=512, q_lora_rank=64, o_groups=2, o_lora_rank=64,
        num_experts_per_tok=2, n_routed_experts=N_EXPERTS, n_shared_experts=1, hc_mult=STREAMS, sliding_window=128,
        layer_types=list(layer_types), mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
        index_n_heads=2, index_head_dim=128, index_topk=512, rope_parameters=_hf_rope(ROPE_SCALING),
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, **ids)
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith((".base", "hc_base", "sinks")):
                p.copy_(torch.randn(p.shape, generator=gen))  # HF's zeros would mix the streams evenly
            elif name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):  # HF's zeros would route every token to expert 0 twice
                b.copy_(torch.stack([torch.randperm(N_EXPERTS, generator=gen)[:2] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
                if decisive_routing:
                    b[torch.randperm(N_EXPERTS, generator=gen)[:cfg.num_experts_per_tok]] += 10.0
        if round_to_bf16:
            for t in list(model.parameters()) + list(model.buffers()):
                if t.is_floating_point():
                    t.copy_(t.to(torch.bfloat16).to(t.dtype))
    hf_dir = out.with_name(out.name + "-hf")
    model.save_pretrained(hf_dir)
    # transformers saves most tensors under DeepSeek's names but keeps a "model." prefix and a few
    # HF names; vLLM's mapper expects the native checkpoint layout.
    renames = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
               "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
    native = {}
    for key, value in load_file(hf_dir / "model.safetensors").items():
        key = key.removeprefix("model.")
        key = renames.get(key, key).replace(".attn.norm.", ".attn.kv_norm.")
        native[key] = value
    out.mkdir(parents=True, exist_ok=True)
    save_file(native, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(compress_ratios=[COMPRESS_RATIO[t] for t in layer_types], num_hash_layers=1,
                  topk_method="noaux_tc", rope_scaling=dict(ROPE_SCALING))
    # Left out as a released config does: HF's own keys (vLLM rejects the layer types' values, and
    # would take the nested ``rope_parameters`` for its flat RoPE dict). HF rebuilds them from the
    # legacy keys: ``partial_rotary_factor`` from ``qk_rope_head_dim`` / ``head_dim``.
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor"):
        config.pop(key)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    GenerationConfig(**ids).save_pretrained(out)
    tok.save_pretrained(out)
    return model


def _hf_rope(scaling: dict[str, Any]) -> dict[str, Any]:
    """``scaling`` as transformers' ``DeepseekV4Config`` reads a legacy ``rope_scaling`` (``type``
    renamed ``rope_type``), so the returned model is the one HF loads from the written folder."""
    rope = {k: v for k, v in scaling.items() if k != "type"}
    rope["rope_type"] = scaling["type"]
    return rope
