"""Scores without rows: an engine built with a head's token inputs reduces every row to the head's
``D`` inputs inside the worker, before anything leaves the device.

One tiny engine, built with a fitted attention head's weight (``D = d_model``). Reference: the same
weight applied on the host to Hugging Face's rows of the token ids vLLM ran
(:meth:`TokenInputs.reduce`), for the first pass, shared prompt rows of n>1, a prefix-cache hit
(rows from the row store) and rows recomputed; the worker's byte counter shows ``D``-wide rows.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from conftest import make_vllm_kwargs
from reference import FP32_TOL, hf_rows
from uhead_vllm.capture.protocol import CaptureSettings
from uhead_vllm.features import FeatureRecipe, StepSpan, step_token_features
from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm
from uhead_vllm.generation.backends import capture_engine_kwargs
from uhead_vllm.heads import AttentionPoolingHead

pytestmark = pytest.mark.slow  # starts an engine

LAYERS = (4, 2)  # not sorted: the weight reads the layers in the recipe's order
D_MODEL = 16
SHARED = "the cat sat on the mat and 12 + 7 = 19 so the dog ran. "


@pytest.fixture(scope="module")
def head(tiny_models):
    """An attention head fitted on HF rows of random token ids (the map, not the fit, is tested)."""
    gen = torch.Generator().manual_seed(5)
    recipe = FeatureRecipe(list(LAYERS), "mean", 0)
    feats = []
    for _ in range(8):
        ids = torch.randint(3, 200, (24,), generator=gen).tolist()
        rows = hf_rows(tiny_models["llama"], ids, LAYERS)
        feats += [step_token_features(rows, 4, StepSpan(a, a + 5), recipe, None) for a in (0, 8, 14)]
    head = AttentionPoolingHead(recipe=recipe, d_model=D_MODEL, nhead=2, dim_feedforward=32, max_epochs=1, progress=False)
    return head.fit(feats, (np.arange(len(feats)) % 3 == 0).astype(int))


@pytest.fixture(scope="module")
def reduced_llm(tiny_models, head, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("token_inputs") / "weight.safetensors")
    head.token_inputs().save(path)
    engine = build_llm(str(tiny_models["llama"]), LAYERS, token_inputs=path, **make_vllm_kwargs())
    yield engine
    del engine
    gc.collect()


def check_reduced(model_path, inputs, res) -> int:
    """Every sample's rows are ``[rows, 1, D]`` and equal the head's map of HF's rows."""
    n = 0
    for per in res.hidden_states:
        for s in per:
            got = s.hidden
            assert got.dtype == torch.float32 and got.shape == (len(s.token_ids) - 1, 1, D_MODEL)
            want = inputs.reduce(hf_rows(model_path, s.token_ids, LAYERS)[:-1])
            err = float(((got[:, 0] - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12)).max())
            assert err < FP32_TOL, f"relative error {err:.3g} over {got.shape[0]} rows"
            n += got.shape[0]
    return n


def test_the_worker_reduces_rows_to_the_heads_inputs(reduced_llm, head, tiny_models):
    """First pass with n=2 (shared prompt rows), then the same prompts again: the prefix cache hits,
    the cached rows come from the row store, and a starved store recomputes them: every row is the
    head's reduced inputs of HF's row, and only D floats per row crossed to the host."""
    model_path, inputs = str(tiny_models["llama"]), head.token_inputs()
    gen = VllmHiddenStatesGenerator(reduced_llm)
    assert gen.hidden_size == D_MODEL and gen.columns == 1
    prompts = [SHARED * 2 + "3 * 4 =", SHARED * 2 + "the mat is"]
    sp = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3)
    first = gen.generate(prompts, sp)
    st = first.stats
    assert check_reduced(model_path, inputs, first) > 0 and st.rows_shared > 0
    assert st.rows_recomputed == 0 and st.bytes_to_host == st.rows_captured * D_MODEL * 4 > 0

    again = gen.generate(prompts, sp)  # prompts' blocks cached: their rows from the store
    assert again.stats.prefix_cache_rows > 0 and again.stats.rows_from_store > 0
    check_reduced(model_path, inputs, again)
    starved = VllmHiddenStatesGenerator(reduced_llm, store_max_bytes=1)
    redo = starved.generate(prompts, sp)  # cached blocks and an empty store: the worker recomputes them
    assert redo.stats.rows_recomputed > 0
    forwarded = redo.stats.tokens_forwarded - redo.stats.rows_skipped  # every row the worker recorded
    assert redo.stats.bytes_to_host == forwarded * D_MODEL * 4 and forwarded > redo.stats.rows_captured
    check_reduced(model_path, inputs, redo)

    sample = first.hidden_states[0][1]
    assert sample.reduced and sample.prompt_rows.data_ptr() == first.hidden_states[0][0].prompt_rows.data_ptr()
    with pytest.raises(ValueError, match="not hidden states"):
        sample.layer(LAYERS[0])
    assert gen.client.status()["hidden_size"] == D_MODEL


def test_token_inputs_refuse_what_they_cannot_reduce(head, tmp_path):
    path = str(tmp_path / "weight.safetensors")
    head.token_inputs().save(path)
    with pytest.raises(ValueError, match="reads layers"):
        capture_engine_kwargs(sorted(LAYERS), token_inputs=path)  # the right layers in another order
    with pytest.raises(ValueError, match="no points"):
        CaptureSettings(LAYERS, points=(("mlp_out", 1),), token_inputs=path)
    with pytest.raises(ValueError, match="dtype float32"):
        CaptureSettings(LAYERS, dtype="bfloat16", token_inputs=path)
    (tmp_path / "other.bin").write_bytes(b"\x80\x04not safetensors")
    with pytest.raises(ValueError, match="not a token-inputs file"):
        capture_engine_kwargs(LAYERS, token_inputs=str(tmp_path / "other.bin"))
    assert CaptureSettings.from_dict(CaptureSettings(LAYERS, token_inputs=path).to_dict()).num_columns == 1
