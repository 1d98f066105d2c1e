"""Tiny random hybrid (attention + state-space) models for capture parity tests.

Each model is built deterministically from a seed, saved as a Hugging Face folder with the tiny
BPE tokenizer of ``uhead_vllm._testing`` and cached under ``.cache/tiny_models/``. Weights are
rescaled after Hugging Face's init so every layer changes the residual stream substantially: with
the default 0.02 init a layer's contribution is ~1e-3 of the stream, and a capture that returned
the wrong tensor (e.g. the residual without the layer delta) would still pass a parity check.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO_ROOT / ".cache" / "tiny_models"
#: Bump when a recipe below changes, so stale cached folders are rebuilt.
HYBRID_RECIPE_VERSION = 4
HIDDEN = 128


@dataclass(frozen=True)
class HybridSpec:
    """How to build one tiny model: the HF config factory and the dtype vLLM must serve it in."""

    architecture: str
    dtype: str
    make_config: Callable[[dict[str, int], int], Any]  # (special token ids, vocab size) -> config
    #: Config fields changed after init, before saving (see the NemotronH / Zamba2 note below).
    saved_overrides: tuple[tuple[str, Any], ...] = ()


def _mamba2(ids: dict[str, int], vocab: int) -> Any:
    from transformers import Mamba2Config

    return Mamba2Config(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=3, num_heads=4,
                        head_dim=64, expand=2, n_groups=1, state_size=16, conv_kernel=4,
                        chunk_size=64, tie_word_embeddings=False, **ids)


def _nemotron_h(ids: dict[str, int], vocab: int) -> Any:
    from transformers import NemotronHConfig

    return NemotronHConfig(vocab_size=vocab, hidden_size=HIDDEN,
                           layers_block_type=["mamba", "attention", "mlp", "mamba"],
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           intermediate_size=256, mamba_num_heads=4, mamba_head_dim=64, n_groups=1,
                           ssm_state_size=16, chunk_size=64, max_position_embeddings=1024,
                           tie_word_embeddings=False, **ids)


def _falcon_h1(ids: dict[str, int], vocab: int) -> Any:
    from transformers import FalconH1Config

    return FalconH1Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=256,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          mamba_d_ssm=256, mamba_n_heads=4, mamba_d_head=64, mamba_n_groups=1,
                          mamba_d_state=16, mamba_chunk_size=64, max_position_embeddings=1024,
                          embedding_multiplier=2.0, tie_word_embeddings=False, **ids)


def _granite_hybrid(ids: dict[str, int], vocab: int) -> Any:
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=256,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  layer_types=["mamba", "attention", "mamba"], num_local_experts=0,
                                  shared_intermediate_size=256, mamba_n_heads=4, mamba_d_head=64,
                                  mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=64,
                                  embedding_multiplier=2.0, residual_multiplier=0.5,
                                  max_position_embeddings=1024, tie_word_embeddings=False, **ids)


def _zamba2(ids: dict[str, int], vocab: int) -> Any:
    from transformers import Zamba2Config

    return Zamba2Config(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=3,
                        layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=16,
                        n_mamba_heads=4, mamba_expand=2, mamba_ngroups=1, chunk_size=64,
                        intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                        num_mem_blocks=1, max_position_embeddings=1024, tie_word_embeddings=False,
                        **ids)


def _qwen3_next(ids: dict[str, int], vocab: int) -> Any:
    from transformers import Qwen3NextConfig

    # Sizing: with prefix caching the attention block grows until one block's KV bytes hold a
    # linear-attention state; 4 KV heads x 64 dims and one 128x128 value head keep it < 128
    # tokens, so prompts of a few hundred tokens span several blocks. vLLM needs at least one MoE
    # layer; it routes to all of its experts, so bf16 rounding cannot flip a top-k choice.
    return Qwen3NextConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=256,
                           num_hidden_layers=4,
                           layer_types=["linear_attention", "linear_attention", "full_attention",
                                        "linear_attention"],
                           num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                           linear_key_head_dim=128, linear_value_head_dim=128,
                           linear_num_key_heads=1, linear_num_value_heads=1,
                           mlp_only_layers=[0, 1, 2], num_experts=2, num_experts_per_tok=2,
                           moe_intermediate_size=64, shared_expert_intermediate_size=64,
                           max_position_embeddings=1024, tie_word_embeddings=False, **ids)


# HF NemotronH and Zamba2 clamp the SSM step dt >= config.time_step_min (default 1e-3); vLLM 0.32's
# MambaMixer2 clamps at 0 only, so the engine itself differs from HF wherever softplus(dt) < 1e-3
# (measured on these tiny models: relative error 1e-3..1e-2). The clamp is a model-definition
# difference, not a capture one: the saved configs set time_step_min ~ 0 (after dt_bias was
# initialised with the default), which makes both implementations compute the same function.
_NO_DT_CLAMP = (("time_step_min", 1e-30),)  # > 0: HF takes its log when initialising

HYBRID_SPECS: dict[str, HybridSpec] = {
    "mamba2": HybridSpec("Mamba2ForCausalLM", "float32", _mamba2),
    "nemotron_h": HybridSpec("NemotronHForCausalLM", "float32", _nemotron_h, _NO_DT_CLAMP),
    "falcon_h1": HybridSpec("FalconH1ForCausalLM", "float32", _falcon_h1),
    "granite_hybrid": HybridSpec("GraniteMoeHybridForCausalLM", "float32", _granite_hybrid),
    "zamba2": HybridSpec("Zamba2ForCausalLM", "float32", _zamba2, _NO_DT_CLAMP),
    # vLLM-CPU runs Qwen3-Next's gated delta-net in bf16 only.
    "qwen3_next": HybridSpec("Qwen3NextForCausalLM", "bfloat16", _qwen3_next),
}


def _rescale(model: Any, seed: int) -> None:
    """Unit-scale embeddings and 1/sqrt(fan_in) matrices, from one seeded generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() < 2:
                continue  # norms, biases, A_log, D, dt_bias: keep HF's (meaningful) init
            if "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _write(name: str, spec: HybridSpec, seed: int, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from uhead_vllm._testing import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id}
    config = spec.make_config(ids, len(tok))
    config.architectures = [spec.architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _rescale(model, seed)
    for key, value in spec.saved_overrides:
        setattr(model.config, key, value)
    dtype = getattr(torch, spec.dtype)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def build_hybrid_model(name: str, seed: int = 0) -> Path:
    """Folder of tiny model ``name`` (a key of :data:`HYBRID_SPECS`), built once and reused."""
    if name not in HYBRID_SPECS:
        raise ValueError(f"unknown tiny hybrid model {name!r}; known: {sorted(HYBRID_SPECS)}")
    spec = HYBRID_SPECS[name]
    final = CACHE_DIR / f"{name}-h{HYBRID_RECIPE_VERSION}-s{seed}"
    recipe = {"name": name, "version": HYBRID_RECIPE_VERSION, "seed": seed}
    stamp = final / "uhead_recipe.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return final
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / f".{final.name}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=CACHE_DIR))
        try:
            _write(name, spec, seed, tmp)
            (tmp / "uhead_recipe.json").write_text(json.dumps(recipe))  # written last: complete
            tmp.chmod(0o755)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def num_layers(path: Path) -> int:
    """Decoder layers of a saved model (NemotronH derives the count from its block types)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    if "layers_block_type" in cfg and cfg.get("model_type") == "nemotron_h":
        return len(cfg["layers_block_type"])
    return int(cfg["num_hidden_layers"])


@lru_cache(maxsize=2)
def _hf_model(path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    # Always fp32: bf16 engines are compared with exact math on the same (bf16) weights.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.tie_last_hidden_states = False  # keep the last entry before the final norm
    return model.eval()


def hybrid_hf_rows(path: Path, token_ids: list[int], layers: tuple[int, ...]) -> Any:
    """``[T, L, H]`` HF reference in our convention (0 = embeddings, k = after layer k-1).

    HF Mamba2 differs: its ``hidden_states`` start after layer 0 and end after the final norm, so
    the embedding entry is taken from the input embeddings and the rest shifted by one.
    """
    import torch

    model = _hf_model(str(path))
    ids = torch.tensor([list(token_ids)])
    n = num_layers(path)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        hs = tuple(out.hidden_states)
        if model.config.architectures[0] == "Mamba2ForCausalLM":
            hs = (model.get_input_embeddings()(ids),) + hs[:n]
    assert len(hs) == n + 1, (len(hs), n)
    return torch.stack([hs[k][0] for k in layers], dim=1).float()
