"""VllmHiddenStatesGenerator at the edges: sequences that fill ``max_model_len`` and concurrent calls.

Rows are checked against Hugging Face's forward on the token ids vLLM ran, as in test_generator.py.
"""

from __future__ import annotations

import gc

import pytest
from vllm import SamplingParams

from conftest import make_vllm_kwargs
from reference import assert_rows_match
from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm

pytestmark = pytest.mark.slow  # every test here starts an engine, a server or a cluster

LAYERS = (0, 2, 4)
MAX_LEN = 96
SHARED = "the cat sat on the mat and 12 + 7 = 19 so the dog ran. "


@pytest.fixture(scope="module")
def model_path(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def llm(model_path):
    engine = build_llm(model_path, LAYERS, **make_vllm_kwargs(max_model_len=MAX_LEN))
    yield engine
    del engine
    gc.collect()


def test_compute_last_token_at_max_model_len_keeps_the_call(llm, model_path):
    """A sample that stops at max_model_len cannot have its last token forwarded (vLLM refuses a
    prompt of max_model_len tokens): the call succeeds, that sample is flagged and has every other
    row exact; the other samples of the same call still get their last row."""
    gen = VllmHiddenStatesGenerator(llm)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    long = SamplingParams(n=2, max_tokens=200, ignore_eos=True, temperature=1.0, seed=3)
    short = SamplingParams(max_tokens=5, temperature=0.0)
    prompts = [SHARED * 2, SHARED + "3 * 4 ="]
    gen.generate(prompts, [long, short])  # fills the prefix cache: the next call has gaps to recompute
    res = gen.generate(prompts, [long, short], compute_last_token=True)
    assert res.stats.prefix_cache_rows > 0
    for s in res.hidden_states[0]:
        assert len(s.token_ids) == MAX_LEN
        assert s.last_row_missing
        assert s.hidden.shape[0] == MAX_LEN - 1
        assert_rows_match(model_path, s.token_ids, s.hidden, LAYERS, 1e-4)
    s = res.hidden_states[1][0]
    assert not s.last_row_missing
    assert s.hidden.shape[0] == len(s.token_ids)
    assert_rows_match(model_path, s.token_ids, s.hidden, LAYERS, 1e-4)
    assert [o.finish_reason for o in res.outputs[0].outputs] == ["length", "length"]


def test_concurrent_generate_calls_on_one_engine_keep_their_own_rows(llm, model_path):
    """Two threads, each with its own generator on the same engine, start together: every call
    returns its own prompts' outputs with rows equal to Hugging Face's (calls are serialised)."""
    import threading

    gens = [VllmHiddenStatesGenerator(llm), VllmHiddenStatesGenerator(llm)]
    prompts = [[SHARED + "3 * 4 =", "red cat"], ["5 + 6 = 11 and", SHARED * 2 + "the mat is"]]
    rounds = 3
    barrier = threading.Barrier(2)
    results: list[list] = [[], []]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for r in range(rounds):
                barrier.wait(timeout=120)
                sp = SamplingParams(n=2, max_tokens=6 + 2 * k + r, temperature=1.0, seed=10 * k + r)
                results[k].append(gens[k].generate(prompts[k], sp))
        except BaseException as exc:  # noqa: BLE001  (re-raised in the main thread)
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for k in range(2):
        assert len(results[k]) == rounds
        for r, res in enumerate(results[k]):
            for i, per in enumerate(res.hidden_states):
                want = gens[k].tokenizer(prompts[k][i])["input_ids"]
                assert list(res.outputs[i].prompt_token_ids) == want
                assert len(per) == 2
                for s in per:
                    assert s.prompt_token_ids == want
                    assert len(s.output_token_ids) == 6 + 2 * k + r
                    assert s.hidden.shape[0] == len(s.token_ids) - 1
                    assert_rows_match(model_path, s.token_ids, s.hidden, LAYERS, 1e-4)


def test_capture_error_in_the_recompute_pass_keeps_vllms_outputs(model_path):
    """The per-call capture budget is exceeded only by the recompute pass (the row store is
    starved, so the prefix-cached prompt rows are recomputed): the error still carries the
    first pass's outputs, as a budget error in the first pass does."""
    from uhead_vllm.generation import CaptureError

    llm = build_llm(model_path, (0, 1), max_capture_bytes=40_000, **make_vllm_kwargs())  # ≈39 fp32 rows
    try:
        gen = VllmHiddenStatesGenerator(llm, store_max_bytes=1)
        prompt = SHARED
        while len(gen.tokenizer(prompt)["input_ids"]) < 100:
            prompt += "the mat is red. "
        n = len(gen.tokenizer(prompt)["input_ids"])
        assert 100 <= n < 96 + 30  # the uncached tail + decode fits the budget, the whole prompt does not
        sp = SamplingParams(max_tokens=3, temperature=0.0)
        with pytest.raises(CaptureError, match="budget"):
            gen.generate([prompt], sp)  # first pass over the whole prompt: over budget, KV cached anyway
        with pytest.raises(CaptureError, match="budget") as err:
            gen.generate([prompt], sp)  # first pass fits (3 blocks cached); the recompute does not
        outs = err.value.outputs
        assert outs is not None and len(outs) == 1
        assert list(outs[0].prompt_token_ids) == gen.tokenizer(prompt)["input_ids"]
        assert len(outs[0].outputs[0].token_ids) == 3
    finally:
        del llm
        gc.collect()
