"""Capture points inside decoder layers and per-request steering, against HF forward hooks.

One eager engine on the tiny llama captures residual layers plus every point at two layers and
allows steering. Every returned row (layers and points) is compared with Hugging Face's fp32
forward on the same ids with hooks on its own modules (tests/point_reference.py), with the same
steering added there; greedy tokens are checked by HF's argmax on the same sequence.
"""

from __future__ import annotations

import gc

import pytest
import torch
from vllm import SamplingParams

from conftest import make_vllm_kwargs
from point_reference import hf_point_run
from reference import FP32_TOL, relative_error
from uhead_vllm.capture.points import ALIASES, SUBLAYER_POINTS, parse_sites
from uhead_vllm.capture.steering import SteerSpec, SteerSpecError
from uhead_vllm.generation import SteeringError, VllmHiddenStatesGenerator, build_llm

LAYERS = (0, 2, 4)  # tiny llama: 4 decoder layers
POINTS = tuple((p, k) for k in (0, 3) for p in SUBLAYER_POINTS)  # every point, first and last layer
SHARED = "the cat sat on the mat and 12 + 7 = 19 so the dog ran to the red mat. "  # > one 32-token block
H = 128


@pytest.fixture(scope="module")
def model_path(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def gen(model_path):
    llm = build_llm(model_path, LAYERS, points=POINTS, steering=True, **make_vllm_kwargs())
    yield VllmHiddenStatesGenerator(llm)
    del llm
    gc.collect()


def _vec(seed: int) -> list[float]:
    return torch.randn(H, generator=torch.Generator().manual_seed(seed)).tolist()


def _check(model_path, sample, steer=(), points=POINTS) -> torch.Tensor:
    """Rows equal HF's (with ``steer``); returns HF's logits for the sequence."""
    ids = sample.token_ids
    ref, logits = hf_point_run(model_path, ids, LAYERS, points, steer)
    assert sample.hidden.shape == (len(ids) - 1, len(LAYERS) + len(points), H)
    err = relative_error(sample.hidden, ref[: len(ids) - 1])
    assert err < FP32_TOL, f"relative error {err:.3g}"
    return logits


@pytest.mark.slow
def test_points_match_hf_hooks_with_prefix_caching_n2_and_steps(gen, model_path):
    prompts = [SHARED + "3 * 4 =", SHARED + "the mat is"]
    first = gen.generate(prompts, SamplingParams(n=2, max_tokens=6, temperature=0.9, seed=3))
    # The prompts' shared first block came from vLLM's prefix cache for all but one request: its
    # rows were written by the request that forwarded them (the next call takes them from the store).
    st = first.stats
    assert st.prefix_cache_rows > 0 and st.rows_from_shared_prefix + st.rows_from_store == st.prefix_cache_rows
    for per in first.hidden_states:
        for s in per:
            _check(model_path, s)
    # Named access agrees with the documented column order (layers first, then points in order).
    s = first.hidden_states[0][1]
    assert torch.equal(s.point("mlp_out", 3), s.hidden[:, len(LAYERS) + POINTS.index(("mlp_out", 3))])
    assert torch.equal(s.point("post_attn", 0), s.point("attn_out", 0))  # alias
    # Multi-step: continue one candidate; its steps accumulate and the rows stay exact.
    cand = first.hidden_states[0][0]
    nxt = gen.generate([cand.prompt + cand.text], SamplingParams(max_tokens=4, temperature=0.0))
    s2 = nxt.hidden_states[0][0]
    assert len(s2.steps) == 2 and s2.steps[0].text == cand.text
    assert nxt.stats.rows_from_store > 0  # the cached prompt blocks of the call before
    _check(model_path, s2)


def _steer_terms(spec: list[dict], prompt_len: int) -> list:
    return [(ALIASES.get(t["point"], t["point"]), t["layer"], t["vector"], t.get("scale", 1.0),
             prompt_len if t.get("tokens") == "generated" else 0) for t in spec]


@pytest.mark.slow
def test_mixed_batch_steering_matches_hf_rows_and_greedy_tokens(gen, model_path):
    prompt = SHARED + "3 * 4 ="
    plain = gen.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))  # warms the prefix cache
    a = [{"point": "mlp_out", "layer": 1, "vector": _vec(1), "scale": 3.0},
         {"point": "resid_post", "layer": 2, "vector": _vec(2), "scale": 2.0},
         {"point": "mlp_out", "layer": 1, "vector": _vec(6), "tokens": "generated"}]  # same site, other tokens
    c = [{"point": "pre_attn", "layer": 0, "vector": _vec(3), "scale": 4.0, "tokens": "generated"},
         {"point": "attn_out", "layer": 3, "vector": _vec(4), "scale": 2.0},
         {"point": "mlp_in", "layer": 3, "vector": _vec(5), "scale": 2.0, "tokens": "generated"}]
    greedy = dict(max_tokens=8, temperature=0.0)
    params = [SamplingParams(**greedy, extra_args={"uhead_steer": a}), SamplingParams(**greedy),
              SamplingParams(**greedy, extra_args={"uhead_steer": c})]
    res = gen.generate([prompt] * 3, params)
    samples = [per[0] for per in res.hidden_states]
    for s, spec in zip(samples, (a, None, c)):
        terms = _steer_terms(spec, s.prompt_len) if spec else []
        logits = _check(model_path, s, terms)
        # Greedy: HF's argmax after every position vLLM sampled from is the token vLLM chose.
        assert logits[s.prompt_len - 1 : len(s.token_ids) - 1].argmax(-1).tolist() == s.output_token_ids
    # The plain request is untouched by its steered neighbours; the steered ones really moved.
    base = plain.hidden_states[0][0]
    n = base.prompt_len
    assert samples[1].token_ids == base.token_ids
    assert relative_error(samples[0].hidden[:n, 1], base.hidden[:n, 1]) > 0.05
    assert samples[0].token_ids != samples[1].token_ids
    # "generated" (attn_in of layer 0): attn_in of layer 3 is plain on prompt rows, not after.
    col = len(LAYERS) + POINTS.index(("attn_in", 3))
    assert relative_error(samples[2].hidden[:n, col], base.hidden[:n, col]) < FP32_TOL
    assert relative_error(samples[2].hidden[n:, col], base.hidden[n:, col]) > 0.05
    # Multi-step with "generated" steering: the next step (a longer prompt) continues c's trajectory
    # and steers from its own prompt end on.
    step2 = gen.generate([samples[2].prompt + samples[2].text], params[2]).hidden_states[0][0]
    assert [st.text for st in step2.steps] == [samples[2].text, step2.text]
    _check(model_path, step2, _steer_terms(c, step2.prompt_len))
    # Same steering again: vLLM's (salted) prefix cache and the salted row store serve it exactly;
    # then with the store emptied, the rows are recomputed with the same steering.
    again = gen.generate([prompt], params[0])
    assert again.stats.prefix_cache_rows > 0 and again.stats.rows_from_store > 0
    assert again.hidden_states[0][0].token_ids == samples[0].token_ids
    _check(model_path, again.hidden_states[0][0], _steer_terms(a, n))
    gen.store.clear()
    third = gen.generate([prompt], params[0])
    assert third.stats.rows_recomputed > 0
    _check(model_path, third.hidden_states[0][0], _steer_terms(a, n))


@pytest.mark.slow
def test_bad_steering_requests_are_refused_before_running(gen):
    bad = [({"point": "nope", "layer": 0, "vector": [0.0] * H}, "unknown point"),
           ({"point": "mlp_out", "layer": 4, "vector": [0.0] * H}, "out of range"),
           ({"point": "mlp_out", "layer": 0, "vector": [0.0] * 3}, "hidden size is 128"),
           ({"point": "mlp_out", "layer": 0, "vector": [0.0] * H, "tokens": "some"}, "tokens must be")]
    for term, message in bad:
        with pytest.raises(SteeringError, match=message):
            gen.generate(["1 + 1 ="], SamplingParams(max_tokens=2, extra_args={"uhead_steer": [term]}))


def test_spec_and_point_parsing():
    spec = SteerSpec.from_extra_args({"uhead_steer": {"point": "post_attn", "layer": 1, "vector": [1, 2],
                                                      "tokens": "generated"}})
    assert spec.terms[0].point == "attn_out" and spec.resolved(7).terms[0].tokens == 7
    assert spec.digest() != spec.resolved(7).digest() and spec.resolved(7).digest() == spec.resolved(7).digest()
    with pytest.raises(SteerSpecError, match="finite"):
        SteerSpec.from_extra_args({"uhead_steer": [{"point": "mlp_out", "layer": 0, "vector": [float("nan")]}]})
    assert parse_sites(["mlp_out.2", ("pre_attn", 0)]) == (("mlp_out", 2), ("attn_in", 0))
    with pytest.raises(ValueError, match="layers="):
        parse_sites([("resid_post", 1)])
    with pytest.raises(ValueError, match="duplicates"):
        parse_sites([("mlp_in", 1), "mlp_in.1"])


@pytest.mark.slow
def test_qwen3_points_and_steering_match_hf(tiny_models):
    path = str(tiny_models["qwen3"])
    points = (("attn_in", 1), ("attn_out", 2), ("mlp_in", 0), ("mlp_out", 2))
    llm = build_llm(path, (0, 3), points=points, steering=True, **make_vllm_kwargs())
    g = VllmHiddenStatesGenerator(llm)
    steer = [{"point": "attn_out", "layer": 1, "vector": _vec(7), "scale": 3.0},
             {"point": "resid_post", "layer": 0, "vector": _vec(8), "tokens": "generated"}]
    greedy = dict(max_tokens=5, temperature=0.0)
    res = g.generate(["9 - 2 = 7 and", "red cat"],
                     [SamplingParams(**greedy), SamplingParams(**greedy, extra_args={"uhead_steer": steer})])
    for per, spec in zip(res.hidden_states, (None, steer)):
        s = per[0]
        ref, logits = hf_point_run(path, s.token_ids, (0, 3), points, _steer_terms(spec, s.prompt_len) if spec else ())
        assert relative_error(s.hidden, ref[: len(s.token_ids) - 1]) < FP32_TOL
        assert logits[s.prompt_len - 1 : len(s.token_ids) - 1].argmax(-1).tolist() == s.output_token_ids
    del g, llm
    gc.collect()


@pytest.mark.slow
def test_steering_needs_an_engine_built_for_it(model_path):
    llm = build_llm(model_path, (0,), **make_vllm_kwargs(kv_cache_memory_bytes=16 << 20))
    with pytest.raises(SteeringError, match="steering=True"):
        VllmHiddenStatesGenerator(llm).generate(["1 +"], SamplingParams(max_tokens=2, extra_args={
            "uhead_steer": [{"point": "mlp_out", "layer": 0, "vector": [0.0] * H}]}))
    del llm
    gc.collect()


@pytest.mark.slow
def test_points_and_steering_in_compiled_mode_are_refused_at_build(model_path):
    for extra in ({"points": POINTS[:1]}, {"steering": True}):
        with pytest.raises(Exception, match="enforce_eager=True"):
            build_llm(model_path, LAYERS, **extra, **make_vllm_kwargs(enforce_eager=False))
        gc.collect()
