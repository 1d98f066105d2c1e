"""Tiny random test models: deterministic random-weight Llama / Qwen3 folders for tests and benchmarks.

Not part of the library's API (hence the leading underscore): ``tests/`` and the CPU benchmarks
(``experiments/bench``) build them; the product code never imports this module.

The models have a small trained byte-level BPE tokenizer and a Qwen3-style chat template (thinking
switch included). They are built deterministically, so a folder built once can be reused by every
test run (:func:`uhead_vllm.models._build_once` publishes it atomically under a lock).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from .models import _build_once

# Bump when the tiny-model recipe changes, so folders cached by an older recipe are rebuilt.
TINY_MODEL_VERSION = 1
TINY_ARCHS = ("llama", "qwen3")


TINY_HIDDEN = 128
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_HEAD_DIM = 32  # in vLLM-CPU's accepted set (32, 64, 80, ...)
TINY_INTERMEDIATE = 256
TINY_MAX_POSITIONS = 1024
TINY_BPE_VOCAB = 510  # + 2 added thinking tokens = 512 tokenizer entries
TINY_LAYERS = {"llama": 4, "qwen3": 3}  # different depths catch layer-index mix-ups
TINY_EMBED_STD = 1.0  # large embeddings keep greedy output context-dependent (see build_tiny_model)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")

# Qwen3-style: enable_thinking defaults to true; when false the generation prompt carries an empty
# thinking block, so the model answers directly.
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

_WORDS = {
    "subj": ["the cat", "a dog", "my friend", "the teacher", "a robot", "the model", "we", "they"],
    "verb": ["sees", "counts", "likes", "adds", "writes", "finds", "checks", "solves"],
    "obj": ["the answer", "a number", "two apples", "the sum", "a red ball", "the problem",
            "seven books", "the next step"],
    "adv": ["quickly", "slowly", "again", "today", "carefully", "first", "then", "finally"],
}


def tiny_corpus(n_lines: int = 600, seed: int = 1234) -> list[str]:
    """Deterministic English + arithmetic text for training the tiny tokenizer."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        kind = i % 6
        if kind == 0:
            lines.append(f"{a} + {b} = {a + b}")
        elif kind == 1:
            lines.append(f"What is {a} - {b}? The answer is {a - b}.")
        elif kind == 2:
            lines.append(f"{a} * {b % 10} = {a * (b % 10)}, so the result is {a * (b % 10)}!")
        elif kind == 3:
            w = {k: rng.choice(v) for k, v in _WORDS.items()}
            lines.append(f"{w['subj'].capitalize()} {w['verb']} {w['obj']} {w['adv']}.")
        elif kind == 4:
            lines.append(f"Let me think step by step: first {a}, then {b}; total {a + b}.")
        else:
            w = {k: rng.choice(v) for k, v in _WORDS.items()}
            lines.append(f"Question: does {w['subj']} know {w['obj']}? Yes, {a} times.")
    return lines


def build_tiny_tokenizer() -> Any:
    """Byte-level BPE tokenizer trained on :func:`tiny_corpus`, with ChatML + thinking tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_BPE_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    # Like Qwen3, thinking markers are single added tokens but not "special": they survive
    # skip_special_tokens=True, so thinking text stays visible when decoding.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=TINY_MAX_POSITIONS,
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def _tiny_config(arch: str, vocab_size: int, num_layers: int, ids: dict[str, int]) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_INTERMEDIATE,
        num_hidden_layers=num_layers,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        head_dim=TINY_HEAD_DIM,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        dtype="float32",
    )
    if arch == "llama":
        cfg = LlamaConfig(**common, rms_norm_eps=1e-5)
        cfg.architectures = ["LlamaForCausalLM"]
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, rms_norm_eps=1e-6, use_sliding_window=False,
                          max_window_layers=num_layers)
        cfg.architectures = ["Qwen3ForCausalLM"]
    else:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    return cfg


def _write_tiny_model(
    out_dir: Path, arch: str, seed: int, vocab_pad: int, num_layers: int
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tiny_tokenizer()
    ids = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
    }
    config = _tiny_config(arch, len(tokenizer) + vocab_pad, num_layers, ids)

    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Fill every parameter from one seeded generator in a fixed order: determinism does not then
    # depend on how transformers happens to initialise modules. Norm weights stay at 1.
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in name:
                # Embeddings much larger than the block outputs (std 0.02) would make greedy
                # decoding a fixed token->token map that soon loops on one token; unit-scale
                # embeddings with unit-scale projections keep attention contributing.
                p.copy_(torch.randn(p.shape, generator=gen) * TINY_EMBED_STD)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]
    )
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def build_tiny_model(
    out_dir: str | Path,
    arch: str,
    *,
    seed: int = 0,
    vocab_pad: int = 0,
    num_layers: int | None = None,
    progress: bool = False,
) -> Path:
    """Build (or reuse) a deterministic tiny random model folder loadable by vLLM and transformers.

    ``vocab_pad > 0`` makes the config vocab exceed ``len(tokenizer)`` like Qwen's padded
    vocabularies, so code that sizes ``[T, vocab]`` matrices by the tokenizer gets caught.
    The folder is reused when its manifest records the same recipe.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    if vocab_pad < 0:
        raise ValueError("vocab_pad must be >= 0")
    layers = TINY_LAYERS[arch] if num_layers is None else int(num_layers)
    source = {
        "recipe": "uhead_vllm.tiny",
        "version": TINY_MODEL_VERSION,
        "arch": arch,
        "seed": seed,
        "vocab_pad": vocab_pad,
        "num_layers": layers,
    }
    return _build_once(
        Path(out_dir).expanduser().resolve(),
        source,
        lambda tmp: _write_tiny_model(tmp, arch, seed, vocab_pad, layers),
        progress,
        f"tiny {arch} model",
    )


__all__ = ["TINY_ARCHS", "TINY_MODEL_VERSION", "build_tiny_model", "build_tiny_tokenizer", "tiny_corpus"]
