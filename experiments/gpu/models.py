"""Random-weight models of real shapes for the GPU machine, which cannot download weights.

A model folder is a ``config.json`` plus a carried tokenizer; ``save_weights=True`` also writes
random weights with transformers (needed where Hugging Face is the parity reference), otherwise
vLLM builds the weights itself (``load_format="dummy"``: benchmarks, where values do not matter).
"""

from __future__ import annotations

import shutil
from pathlib import Path

#: Llama shapes: SmolLM2-135M (the embedded model's), a TP-divisible variant, and Llama-3-8B's.
SHAPES: dict[str, dict] = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    # SmolLM2's depth with heads a tensor-parallel size of 2 divides (SmolLM2's 9 do not): TP tests.
    "smollm2_tp": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build_model(dest: Path, shape: str, tokenizer_dir: Path, *, save_weights: bool, seed: int = 0) -> Path:
    """Write a Llama of ``shape`` with the carried tokenizer to ``dest`` (kept if already there)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dest = Path(dest)
    marker = dest / ("model.safetensors" if save_weights else "config.json")
    if marker.exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=4096, rope_theta=100000.0,
                         bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", **SHAPES[shape])
    if save_weights:
        torch.manual_seed(seed)
        LlamaForCausalLM(config).to(torch.float32).save_pretrained(dest)
    else:
        config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, dest / name)
    return dest
