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
