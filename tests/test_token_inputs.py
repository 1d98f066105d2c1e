"""Heads scored from per-token reduced inputs equal heads scored from the full features.

The reduction (heads/token_inputs.py) is what runs where the rows are, so only ``D`` numbers per
token cross to the host. Reference: Hugging Face's rows of a tiny model on the same token ids,
turned into step features on the host (features.py) and scored by the head's own
``decision_function``. No vLLM engine: a few seconds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reference import hf_rows
from uhead_vllm.capture.protocol import CaptureSettings
from uhead_vllm.features import FeatureRecipe, StepSpan, step_token_features
from uhead_vllm.heads import AttentionPoolingHead, LinearProbeHead, RankingProbeHead, UncertaintyHead

LAYERS = [3, 1]  # not sorted: the recipe's order is the order the weight reads
TOPK = 3
PROMPT_LEN = 5


@pytest.fixture(scope="module")
def steps(tiny_models):
    """Steps of six sequences: HF rows of the generated part, synthetic top-k logprobs per token."""
    gen = torch.Generator().manual_seed(7)
    out = []  # (rows of the step [t, L, H], logprobs [t, k], features [t, F])
    recipe = FeatureRecipe(layers=LAYERS, logprob_topk=TOPK)
    for _ in range(6):
        ids = torch.randint(3, 200, (PROMPT_LEN + 36,), generator=gen).tolist()
        rows = hf_rows(tiny_models["llama"], ids, LAYERS)
        lps = -torch.rand(len(ids) - PROMPT_LEN, TOPK, generator=gen).cumsum(1)
        cuts = [0, *sorted(torch.randperm(35, generator=gen)[:5].add(1).tolist()), 36]
        for a, b in zip(cuts[:-1], cuts[1:]):
            span = StepSpan(a, b)
            feats = step_token_features(rows, PROMPT_LEN, span, recipe, lps)  # rows in recipe order, then logprobs
            out.append((rows[PROMPT_LEN + a: PROMPT_LEN + b], lps[a:b], feats))
    return out


def _fitted(kind: str, feats: list[torch.Tensor]) -> UncertaintyHead:
    labels = np.arange(len(feats)) % 3 == 0  # any labels with both classes: the map, not the fit, is tested
    if kind == "attention":
        head: UncertaintyHead = AttentionPoolingHead(recipe=FeatureRecipe(LAYERS, "mean", TOPK), d_model=16, nhead=2,
                                                     dim_feedforward=32, max_epochs=3, progress=False)
    elif kind == "ranking":
        head = RankingProbeHead(recipe=FeatureRecipe(LAYERS, "mean_last", TOPK), epochs=20)
    else:
        head = LinearProbeHead(recipe=FeatureRecipe(LAYERS, kind, TOPK), max_iter=200)
    return head.fit(feats, labels.astype(int))


@pytest.mark.parametrize("kind", ["mean", "last", "mean_last", "ranking", "attention"])
def test_reduced_inputs_score_like_the_full_features(steps, kind):
    rows, lps, feats = zip(*steps)
    head = _fitted(kind, list(feats))
    inputs = head.token_inputs()
    assert inputs.layers == tuple(LAYERS) and inputs.logprob_topk == TOPK
    want_width = {"mean": 1, "last": 1, "mean_last": 2, "ranking": 2, "attention": 16}[kind]
    assert inputs.width == want_width  # what crosses per token, against L * H of the rows
    reduced = [inputs.reduce(r) for r in rows]
    got = inputs.decide(reduced, list(lps))
    want = head.decision_function(list(feats))
    assert np.ptp(want) > 1e-3  # the steps score differently, so a mixed-up step would show
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_reduced_inputs_refuse_what_does_not_fit(steps):
    rows, lps, feats = zip(*steps)
    inputs = _fitted("mean", list(feats)).token_inputs()
    with pytest.raises(ValueError, match="values per token"):
        inputs.reduce(rows[0][:, :1])  # one layer of two
    with pytest.raises(ValueError, match="logprobs"):
        inputs.decide([inputs.reduce(rows[0])])  # the recipe reads logprobs


# --- the server's scores from reduced inputs (serve --scores-on-device), offline -------------------


def _answer(tiny_models):
    """A generated answer of three lines: token ids, per-token logprob dicts (top-3 + sampled), and
    HF rows of the generated tokens ``[T - 1, L, H]`` (the last token has none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models["llama"]))
    prompt = tok("what is 3 + 4?")["input_ids"]
    ids = tok("3 + 4 = 7\nso the cat sat\nthe answer is 7.")["input_ids"]
    gen = torch.Generator().manual_seed(3)
    logprobs = [{t: -0.1 * (1 + j) - float(torch.rand(1, generator=gen)) for j, t in enumerate((tid, tid + 1, tid + 2))}
                for tid in ids]
    rows = hf_rows(tiny_models["llama"], prompt + ids, LAYERS)[len(prompt): len(prompt) + len(ids) - 1]
    return tok, ids, logprobs, rows


@pytest.mark.parametrize("kind", ["mean_last", "attention"])
def test_the_servers_scorer_scores_reduced_inputs_like_the_full_rows(steps, tiny_models, kind):
    """``Scorer`` with the head's token inputs, on rows the worker would return (``[T, 1, D]``),
    gives the scores the head gives on the full rows: the answer's and every step's."""
    from uhead_vllm.heads import HeadUsage
    from uhead_vllm.serving.scoring import Scorer

    head = _fitted(kind, [f for _, _, f in steps])
    head.usage = HeadUsage("step", "max_step", {"style": "steps_plain", "max_tokens": 32, "temperature": 0.0,
                                                "logprobs": TOPK, "split_mode": "line", "seed": 0})
    tok, ids, logprobs, rows = _answer(tiny_models)
    inputs = head.token_inputs()
    full = Scorer(head, "h", tok, LAYERS).score(ids, logprobs, "", "stop", rows)
    reduced = Scorer(head, "h", tok, LAYERS, inputs).score(ids, logprobs, "", "stop", inputs.reduce(rows)[:, None])
    assert len(full["steps"]) == 3 and [s["token_end"] for s in full["steps"]] == [s["token_end"] for s in reduced["steps"]]
    want = [full["answer_p_wrong"]] + [s["p_wrong"] for s in full["steps"]]
    got = [reduced["answer_p_wrong"]] + [s["p_wrong"] for s in reduced["steps"]]
    assert np.ptp(want[1:]) > 1e-4  # the steps score differently, so a mixed-up step would show
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="read layers"):
        Scorer(head, "h", tok, LAYERS[::-1], inputs)


def test_a_scores_on_device_server_refuses_rows_and_builds_its_settings(steps, tiny_models, tmp_path):
    """The request check answers rows / features with the switch's explanation; the launcher's
    settings carry the served head's layers and its weight file (safetensors)."""
    from uhead_vllm.capture.token_weight import load_weight
    from uhead_vllm.errors import BadUncertaintyRequest, InputError
    from uhead_vllm.serving.launch import capture_settings
    from uhead_vllm.serving.spec import ServerLimits, parse_uncertainty

    limits = ServerLimits(tuple(LAYERS), 16, "h", 1 << 20, reduced=True)
    with pytest.raises(BadUncertaintyRequest, match="without --scores-on-device to get rows"):
        parse_uncertainty({"rows": {"layers": [LAYERS[0]]}}, limits)
    with pytest.raises(BadUncertaintyRequest, match="head's features"):
        parse_uncertainty({"features": True}, limits)
    assert parse_uncertainty(True, limits).steps

    head = _fitted("mean", [f for _, _, f in steps])
    head.save(tmp_path / "head")
    model = str(tiny_models["llama"])
    settings = capture_settings(model, str(tmp_path / "head"), None, scores_on_device=True)
    assert settings.layers == tuple(LAYERS) and settings.num_columns == 1 and settings.dtype == "float32"
    layers, weight = load_weight(settings.token_inputs)
    assert layers == tuple(LAYERS) and torch.equal(weight, head.token_inputs().weight)
    from types import SimpleNamespace

    from uhead_vllm.serving.plugin import add_capture

    args = SimpleNamespace(model=model, worker_extension_cls=None,  # the plugin's config key, as vLLM's EngineArgs
                           additional_config={"uhead_vllm_serve": {"head": str(tmp_path / "head"), "scores_on_device": True}})
    add_capture(args)
    plugin = CaptureSettings.from_dict(args.additional_config["uhead_vllm"])
    assert plugin.layers == tuple(LAYERS) and load_weight(plugin.token_inputs)[0] == tuple(LAYERS)
    with pytest.raises(InputError, match="drop --layers"):
        capture_settings(model, str(tmp_path / "head"), [1, 3], scores_on_device=True)
    with pytest.raises(InputError, match="needs a head"):
        capture_settings(model, "none", None, scores_on_device=True)
