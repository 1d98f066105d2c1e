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
