"""thinkbooster's own strategies scored by an uncertainty head through UHeadVLLMModel.

End to end on the tiny Llama: a head is trained on the fly on the tiny model's captured rows and
saved to a tmp dir; thinkbooster's online best-of-n and beam search each run two steps through
``UHeadVLLMModel``; every candidate must carry a validity score equal to 1 - P(wrong) of the head
on exactly its tokens, and the rows behind every score must equal Hugging Face's forward on the
candidate's real context (prompt + trajectory so far + candidate).
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import torch
import pytest
from vllm import SamplingParams

from conftest import make_vllm_kwargs
from reference import hf_rows, relative_error
from uhead_vllm.features import FeatureRecipe
from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm
from uhead_vllm.heads import LinearProbeHead
from uhead_vllm.models import model_identity
from uhead_vllm.thinkbooster import (
    HeadScorer,
    MeanNLLScorer,
    MeanTokenEntropyScorer,
    RandomScorer,
    UHeadVLLMModel,
    default_head_dir,
    load_step_head,
    make_scorer,
    probability_to_uncertainty,
)
from uhead_vllm.thinkbooster.scorers import CandidateStep, StepSpan
from uhead_vllm.thinkbooster.strategies import make_step_generator, make_strategy

LAYERS = (1, 4)  # a middle layer and the last one (before the final norm) of the 4-layer tiny Llama
# Stop strings the random tiny model emits now and then; they must be non-alphanumeric (thinkbooster
# expands words into "\nWord " forms) and regex-safe (its detector also compiles them).
MARKERS = ("\n", "=", "-", "/", "<", ">")
CHATS = [
    [{"role": "user", "content": "12 + 7 = ? Write one step per line."}],
    [{"role": "user", "content": "the cat counts two apples"}],
]
TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_models):
    """One capturing engine for the module (prefix caching on, no prompt chunking: seeded requests)."""
    path = tiny_models["llama"]
    llm = build_llm(str(path), LAYERS, **make_vllm_kwargs(max_model_len=1024, max_num_batched_tokens=1024))
    yield path, VllmHiddenStatesGenerator(llm)
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def head_dir(engine, tmp_path_factory):
    """A linear probe trained on the fly on 4-token chunks of the tiny model's own rows."""
    path, gen = engine
    res = gen.generate(["the cat sees", "12 + 7 ="], SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=0))
    steps = [s.generated_rows()[a : a + 4].reshape(4, -1)
             for row in res.hidden_states for s in row for a in range(0, 12, 4)]
    labels = np.arange(len(steps)) % 2  # arbitrary but both classes: this head tests plumbing
    head = LinearProbeHead(recipe=FeatureRecipe(list(LAYERS)), model_identity=model_identity(path))
    out = tmp_path_factory.mktemp("tiny_head")
    head.fit(steps, labels).save(out)
    return out


@pytest.fixture(scope="module")
def head_model(engine, head_dir):
    path, gen = engine
    head = load_step_head(head_dir, path)
    return UHeadVLLMModel(gen, HeadScorer(head), keep_stop_strings=True, record_scores=True)


def run_two_steps(model: UHeadVLLMModel, kind: str, **strategy_kwargs):
    """Run a thinkbooster strategy for two steps; return its results and every candidate it saw."""
    # thinkbooster ends a trajectory once it reaches min(budget - buffer, steps * step_limit) - 200
    # tokens; a 201-token step limit with two steps guarantees that step 2 is always generated.
    # Token-id stops on number tokens keep the random model's steps short (fewer decode steps).
    numbers = [i for t, i in model.tokenizer.get_vocab().items()
               if any(ch.isdigit() for ch in model.tokenizer.convert_tokens_to_string([t]))]
    step_gen = make_step_generator(model, temperature=1.0, min_step_tokens=2, max_step_tokens=201,
                                   max_new_tokens=16, max_context_budget=1024, markers=MARKERS,
                                   stop_token_ids=numbers, seed=0)
    seen = []
    generate = step_gen._generate_step_candidates_impl  # test-only spy on the instance

    def spy(*args, **kwargs):
        out = generate(*args, **kwargs)
        seen.extend(c for cands in out for c in cands)
        return out

    step_gen._generate_step_candidates_impl = spy
    strategy = make_strategy(kind, step_gen, max_steps=2, prompt_buffer=100, **strategy_kwargs)
    model.score_records.clear()
    model.reset_hs_step_cache()
    return strategy.generate_trajectories_batch(CHATS), seen, step_gen


def is_chain(text: str, pieces: set[str]) -> bool:
    """``text`` is a concatenation of candidate texts (a trajectory made of steps seen so far)."""
    return text == "" or any(p and text.startswith(p) and is_chain(text[len(p):], pieces) for p in pieces)


def check_scores_against_hf(model: UHeadVLLMModel, path, candidates, base_prompts) -> None:
    """Every candidate has validity = 1 - P_head(HF rows of exactly its tokens in its real context)."""
    records = {(r.prompt, tuple(r.output_token_ids), r.claim_range): r for r in model.score_records}
    head = model.estimator.head
    raw_texts = {c.raw_text for c in candidates}
    for c in candidates:
        v, u = c.other_data["validity_score"], c.other_data["uncertainty_score"]
        assert v is not None and u is not None, "a candidate was not scored"
        assert v == pytest.approx(1.0 / (1.0 + u))
        handle = c.output.uhead_candidate
        rec = records[(handle.prompt, tuple(handle.output_token_ids), (0, len(c.token_ids)))]
        assert rec.uncertainty == u
        # The scored context is the chat prompt plus this candidate's own trajectory so far.
        base = next(b for b in base_prompts if rec.prompt.startswith(b))
        rest = rec.prompt[len(base):]
        assert is_chain(rest, raw_texts), f"scored under a foreign context: {rest!r}"
        plen = len(rec.prompt_token_ids)
        ref = hf_rows(path, rec.prompt_token_ids + rec.output_token_ids, LAYERS)
        ref = ref[plen + rec.span.start : plen + rec.span.end]
        assert rec.rows.shape == ref.shape
        assert relative_error(rec.rows, ref) < TOL
        p_ref = float(head.predict_proba([ref.reshape(ref.shape[0], -1)])[0])
        assert v == pytest.approx(1.0 - p_ref, abs=1e-4)
        assert rec.span.end == len(c.token_ids) or c.token_ids[-1] in model.tokenizer.all_special_ids


def base_prompts(step_gen) -> list[str]:
    return [step_gen._apply_chat_template(chat, enable_thinking=False) for chat in CHATS]


@pytest.mark.slow
def test_online_best_of_n_two_steps(engine, head_model):
    path, _ = engine
    results, seen, step_gen = run_two_steps(head_model, "online_best_of_n", candidates_per_step=3)
    assert [r["reasoning_steps"] for r in results] == [2, 2]
    # 2 questions x 3 candidates x 2 steps, plus 3 final-answer candidates each.
    assert len(seen) == 18
    check_scores_against_hf(head_model, path, seen, base_prompts(step_gen))
    for r in results:
        assert r["validity_scores"] == [s.other_data["validity_score"] for s in r["steps"]]
        for s in r["steps"]:  # stop strings kept, so line structure survives in the trajectory
            if isinstance(s.output.stop_reason, str):
                assert s.raw_text.endswith(s.output.stop_reason)


@pytest.mark.slow
def test_beam_search_two_steps(engine, head_model):
    path, _ = engine
    results, seen, step_gen = run_two_steps(head_model, "beam_search", beam_size=2, candidates_per_beam=2,
                                            aggregation="min")
    assert [len(r["steps"]) for r in results] == [2, 2]
    assert len(seen) == 2 * (2 + 4)  # step 1: one root beam x 2; step 2: two beams x 2
    check_scores_against_hf(head_model, path, seen, base_prompts(step_gen))
    for r in results:
        assert r["validity_scores"] == [s.other_data["validity_score"] for s in r["steps"]]


@pytest.mark.slow
def test_score_refuses_what_it_cannot_score(engine, head_model):
    _, gen = engine
    out = head_model.generate(["the cat"], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0]
    ids = list(out.token_ids)
    assert head_model.score(ids, out.logprobs, output=out) >= 0
    with pytest.raises(ValueError, match="do not match"):
        head_model.score(ids[::-1] if len(set(ids)) > 1 else [ids[0] + 1] + ids[1:], None, output=out)
    with pytest.raises(ValueError, match="needs output="):
        head_model.score(ids, None)
    with pytest.raises(ValueError, match="empty step"):
        head_model.score([], None, output=out, claim_range=(0, 0))
    # A head over layers the engine does not capture is refused up front.
    other = LinearProbeHead(recipe=FeatureRecipe([2]))
    with pytest.raises(ValueError, match="does not capture"):
        UHeadVLLMModel(gen, HeadScorer(other))


@pytest.mark.slow
def test_logprob_baselines_through_the_model(engine):
    _, gen = engine
    model = UHeadVLLMModel(gen, MeanTokenEntropyScorer())
    assert model.compute_last_token is False  # no rows needed, no last-token recompute
    res = model.generate(["12 + 7 ="], SamplingParams(max_tokens=8, temperature=1.0, seed=1, logprobs=5))
    out = res[0].outputs[0]
    assert out.uhead_candidate.hidden is None
    k = len(out.token_ids)
    ents = [-sum(np.exp(v.logprob) * v.logprob for v in d.values()) for d in out.logprobs[:k]]
    assert model.score(list(out.token_ids), out.logprobs, output=out) == pytest.approx(np.mean(ents))
    assert res[0].uncertainty_scores[0] == pytest.approx(np.mean(ents))


def test_scorer_factory_and_head_location(head_dir, engine, monkeypatch):
    path, _ = engine
    head = load_step_head(head_dir, path)
    assert isinstance(make_scorer("head", head), HeadScorer)
    assert isinstance(make_scorer("entropy"), MeanTokenEntropyScorer)
    assert isinstance(make_scorer("mean_nll"), MeanNLLScorer)
    with pytest.raises(ValueError, match="unknown scorer"):
        make_scorer("oracle")
    with pytest.raises(ValueError, match="needs a head"):
        make_scorer("head")
    monkeypatch.setenv("UHEAD_VLLM_HEAD_DIR", str(head_dir))
    assert default_head_dir() == head_dir
    with pytest.raises(FileNotFoundError, match="no uncertainty head"):
        load_step_head(head_dir / "missing", path)


def test_scorer_mappings():
    for p in (0.0, 0.2, 0.5, 0.9, 1.0):
        u = probability_to_uncertainty(p)
        assert 1.0 / (1.0 + u) == pytest.approx(1.0 - p, abs=1e-5)
    with pytest.raises(ValueError):
        probability_to_uncertainty(float("nan"))
    lp = lambda x: SimpleNamespace(logprob=x)  # noqa: E731
    logprobs = [{5: lp(-0.1), 6: lp(-2.5)}, {7: lp(-1.0), 5: lp(-0.5)}]
    step = CandidateStep([5, 7], StepSpan(0, 2), None, (), logprobs)
    assert MeanNLLScorer().uncertainty(step) == pytest.approx((0.1 + 1.0) / 2)
    ent = np.mean([-(np.exp(-0.1) * -0.1 + np.exp(-2.5) * -2.5), -(np.exp(-1.0) * -1.0 + np.exp(-0.5) * -0.5)])
    assert MeanTokenEntropyScorer().uncertainty(step) == pytest.approx(ent)
    a, b = RandomScorer(3), RandomScorer(3)
    assert [a.uncertainty(step) for _ in range(4)] == [b.uncertainty(step) for _ in range(4)]
    with pytest.raises(ValueError, match="no hidden states"):
        head = LinearProbeHead(recipe=FeatureRecipe([1]))
        HeadScorer(head).features(step)


@pytest.mark.parametrize("topk", [0, 3])
def test_batched_features_equal_per_step_features(topk):
    """The value study scores thousands of candidates per step with ``features_batch``: the same
    tensors as ``features`` step by step, including steps that cannot join the batch."""
    gen = torch.Generator().manual_seed(0)
    lp = lambda x: SimpleNamespace(logprob=x)  # noqa: E731
    head = HeadScorer(LinearProbeHead(recipe=FeatureRecipe([4, 0], logprob_topk=topk)))
    steps = []
    for i in range(7):
        n = 3 + i
        logprobs = [{t: lp(float(-torch.rand(1, generator=gen))) for t in range(5)} for _ in range(n)]
        start = i % 3
        steps.append(CandidateStep(list(range(n)), StepSpan(start, n - 1), torch.randn(n, 3, 8, generator=gen),
                                   (0, 2, 4), logprobs))
    steps.append(CandidateStep([1, 2, 3], StepSpan(0, 2), torch.randn(3, 2, 8, generator=gen), (4, 0),
                               steps[0].logprobs))  # other captured layers: done on its own
    batched = head.features_batch(steps, chunk=3)
    assert len(batched) == len(steps)
    for st, b in zip(steps, batched):
        assert torch.equal(b, head.features(st))
        assert b.shape == (len(st.span), 2 * 8 + topk)
    bad = CandidateStep([1, 2], StepSpan(0, 5), torch.randn(2, 3, 8), (0, 2, 4), steps[6].logprobs)
    with pytest.raises(ValueError, match="rows"):
        head.features_batch([steps[0], bad])
