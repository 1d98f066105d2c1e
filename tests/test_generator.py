"""VllmHiddenStatesGenerator: exact rows for every sample at every step, despite prefix caching.

Each check compares the returned rows with Hugging Face's forward on the exact token ids vLLM ran.
"""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from vllm import SamplingParams

from conftest import make_vllm_kwargs
from reference import assert_rows_match
from uhead_vllm.generation import MissingRowsError, VllmHiddenStatesGenerator, build_llm

pytestmark = pytest.mark.slow  # every test here starts an engine, a server or a cluster

LAYERS = (0, 2, 4)  # tiny llama has 4 decoder layers: embeddings, middle, last (pre-norm)
SHARED = "the cat sat on the mat and 12 + 7 = 19 so the dog ran. "  # shared prompt prefix
TAILS = ["3 * 4 =", "5 + 6 =", "the mat is", "9 - 2 = 7 and", "red cat"]


@pytest.fixture(scope="module")
def llm(tiny_models):
    engine = build_llm(str(tiny_models["llama"]), LAYERS, **make_vllm_kwargs())
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def model_path(tiny_models):
    return str(tiny_models["llama"])


def check_all(model_path, res) -> int:
    n = 0
    for per in res.hidden_states:
        for s in per:
            assert s.hidden.shape[0] == len(s.token_ids) - 1
            assert_rows_match(model_path, s.token_ids, s.hidden, LAYERS, 1e-4)
            n += s.hidden.shape[0]
    return n


#: Examples of the randomized multi-step test (CI default; raise it for a longer soak).
MULTISTEP_EXAMPLES = int(os.environ.get("UHEAD_MULTISTEP_EXAMPLES", "16"))


def expected_history(prompt: str, candidates: dict[str, tuple[int, list]]) -> list:
    """The step-cache rule (generation/step_cache.py), stated as a spec: the longest candidate key
    the prompt starts with, unless the prompt reaches further into keys it is a prefix of (a
    trimmed candidate), then the shortest of those; an exact match wins a tie."""
    p = prompt.rstrip()
    full = [k for k in candidates if p.startswith(k)]
    trimmed = [k for k, (plen, _) in candidates.items() if k.startswith(p) and len(p) > plen]
    best_full = max(full, key=len, default=None)
    best_trim = min(trimmed, key=len, default=None)
    if best_trim is not None and (best_full is None or len(p) > len(best_full)):
        return candidates[best_trim][1]
    return candidates[best_full][1] if best_full is not None else []


@settings(max_examples=MULTISTEP_EXAMPLES, deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_multistep_best_of_n_and_beam_rows_exact(llm, model_path, data):
    """Random online best-of-n / beam-search runs: every row of every sample at every step is exact,
    and every candidate's history is the one the step-cache rule gives, rows included — also when a
    trimmed candidate's text is a prefix of a sibling's, with a starved row store (rows recomputed)
    and in strict mode (a full store must serve every prefix-cache hit)."""
    starved = data.draw(st.booleans(), label="starved store")
    gen = VllmHiddenStatesGenerator(llm, store_max_bytes=1 if starved else 1 << 30, strict=not starved)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    n_prompts = data.draw(st.integers(1, 3), label="prompts")
    roots = [SHARED * data.draw(st.integers(1, 2)) + data.draw(st.sampled_from(TAILS)) for _ in range(n_prompts)]
    if data.draw(st.booleans(), label="repeat a prompt"):
        roots.append(roots[0])
    beam = data.draw(st.booleans(), label="beam")
    # every candidate so far: normalised key -> (normalised prompt length, [(text, rows) per step])
    candidates: dict[str, tuple[int, list]] = {}
    live = [(r, []) for r in roots]  # (prompt text, expected [(text, rows)] of its previous steps)
    for step in range(3):
        n = data.draw(st.integers(1, 3), label="n")
        # Seeded so that the sampled texts, and hence later draws, replay identically.
        sp = SamplingParams(n=n, max_tokens=data.draw(st.integers(3, 10)), min_tokens=2, temperature=1.0,
                            seed=data.draw(st.integers(0, 1000), label="seed"))
        res = gen.generate([p for p, _ in live], sp)
        check_all(model_path, res)
        if step > 0:
            assert res.stats.prefix_cache_rows > 0
            if starved:
                assert res.stats.rows_from_store == 0 and res.stats.rows_recomputed > 0
            else:
                assert res.stats.rows_from_store > 0 and res.stats.rows_recomputed == 0
        made = {}
        for (prompt, past), per in zip(live, res.hidden_states):
            for s in per:
                assert [r.text for r in s.steps] == [t for t, _ in past] + [s.text], "wrong history"
                for rec, (_, rows) in zip(s.steps, past):
                    assert torch.equal(rec.hidden, rows), "history rows are another candidate's"
                assert torch.equal(s.steps[-1].hidden, s.generated_rows())
                made[(prompt + s.text).rstrip()] = (len(prompt.rstrip()), past + [(s.text, s.generated_rows())])
        candidates.update(made)  # looked up only from the next call on, as the generator does
        nxt = []
        for (prompt, past), per in zip(live, res.hidden_states):
            keep = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 if beam else 1, unique=True))
            for k in keep:
                text = per[k].text
                if data.draw(st.booleans(), label="trim") and len(text) > 2:
                    cut = text[: len(text) - data.draw(st.integers(1, 2))]
                    if cut.strip():
                        text = cut  # strategy trims the candidate (stop marker, whitespace)
                nxt.append((prompt + text, expected_history(prompt + text, candidates)))
        live = nxt[:4]
    assert gen.stats.prefix_cache_rows > 0


def test_starved_store_recomputes_exactly_and_strict_mode_raises(llm, model_path):
    prompts = [SHARED * 2 + t for t in TAILS[:3]]
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    gen = VllmHiddenStatesGenerator(llm, store_max_bytes=1)  # nothing fits in the store
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    gen.generate(prompts, sp)
    res = gen.generate(prompts, sp)  # vLLM now serves the shared blocks from its prefix cache
    assert res.stats.prefix_cache_rows > 0
    assert res.stats.rows_from_store == 0 and res.stats.rows_recomputed > 0
    check_all(model_path, res)

    strict = VllmHiddenStatesGenerator(llm, store_max_bytes=1, strict=True)
    with pytest.raises(MissingRowsError, match="strict mode"):
        strict.generate(prompts, sp)


def test_rows_edited_in_place_are_recomputed_not_served(llm, model_path):
    prompts = [SHARED * 2 + t for t in TAILS[:2]]
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    gen = VllmHiddenStatesGenerator(llm)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    first = gen.generate(prompts, sp)
    samples = [s for per in first.hidden_states for s in per]
    assert first.stats.rows_placed == first.stats.rows_captured > 0  # in-process: written while generating
    # The store and step cache hold the call's rows (at least: the store may also hold older calls').
    assert first.stats.held_bytes >= sum(s.hidden.numel() * s.hidden.element_size() for s in samples)
    rows = samples[0].hidden
    rows.mul_(0.0)  # a user edits returned rows in place: the store shares them, must not serve them
    res = gen.generate(prompts, sp)  # vLLM serves the shared blocks from its prefix cache
    assert res.stats.prefix_cache_rows > 0 and res.stats.store_stale_drops > 0
    assert res.stats.rows_recomputed > 0
    check_all(model_path, res)


def test_diverging_candidates_keep_their_own_rows(llm, model_path):
    gen = VllmHiddenStatesGenerator(llm)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    root = SHARED * 2
    common = "3 * 4 = 12 and "
    a, b = root + common + "the cat", root + common + "5 + 6 = 11"
    sp = SamplingParams(max_tokens=5, temperature=0.0)
    first = gen.generate([root], SamplingParams(max_tokens=4, temperature=0.0))
    res = gen.generate([a, b], sp)
    sa, sb = res.hidden_states[0][0], res.hidden_states[1][0]
    shared_len = len(gen.tokenizer(root + common)["input_ids"]) - 1
    assert sa.token_ids[:shared_len] == sb.token_ids[:shared_len]
    assert sa.token_ids != sb.token_ids
    assert_rows_match(model_path, sa.token_ids, sa.hidden, LAYERS, 1e-4)
    assert_rows_match(model_path, sb.token_ids, sb.hidden, LAYERS, 1e-4)
    assert res.stats.rows_from_store > 0  # the shared prefix was filled, not recomputed
    # Histories are per candidate: the next step of each continues its own trajectory.
    nxt = gen.generate([a + sa.text, b + sb.text], sp)
    assert [r.text for r in nxt.hidden_states[0][0].steps] == [sa.text, nxt.hidden_states[0][0].text]
    assert [r.text for r in nxt.hidden_states[1][0].steps] == [sb.text, nxt.hidden_states[1][0].text]
    assert torch.equal(nxt.hidden_states[0][0].steps[0].hidden, sa.generated_rows())
    assert first.hidden_states[0][0].steps[0].text == first.hidden_states[0][0].text


def test_n_samples_match_vllm_seeding_and_share_prompt_rows(llm, model_path):
    gen = VllmHiddenStatesGenerator(llm)
    sp4 = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11)
    before = copy.deepcopy(sp4)
    sent: list = []
    send = llm.generate
    llm.generate = lambda prompts, params, **kw: sent.extend(params) or send(prompts, params, **kw)
    try:
        res = gen.generate(["5 + 6 = 11 and"], sp4)
    finally:
        del llm.generate  # the bound method again
    # The requests' params are the generator's own, one per sample, so vLLM skips its deep copy of
    # each (experiments/bench/request_adding.py); never the caller's object, which vLLM would
    # otherwise update in place (its stop ids).
    assert len(sent) == 4 and all(p.skip_clone and p is not sp4 for p in sent)
    assert repr(sp4) == repr(before) and sp4._all_stop_token_ids == before._all_stop_token_ids
    assert not sp4.skip_clone
    one = gen.generate(["5 + 6 = 11 and"], SamplingParams(n=1, max_tokens=6, temperature=1.0, seed=11))
    samples = res.hidden_states[0]
    assert [s.sample_index for s in samples] == [0, 1, 2, 3]
    assert [o.index for o in res.outputs[0].outputs] == [0, 1, 2, 3]
    assert samples[0].output_token_ids == one.hidden_states[0][0].output_token_ids  # child 0 = seed
    check_all(model_path, res)
    p = samples[0].prompt_len
    for s in samples[1:]:
        assert torch.allclose(s.hidden[:p], samples[0].hidden[:p], atol=1e-5)


def test_requests_get_their_cached_prompt_rows_from_the_one_that_forwarded_them(llm, model_path):
    """vLLM computes a shared prompt prefix once and serves it to the other requests from its
    prefix cache: the samples of one prompt (they share sample 0's rows), and prompts that share
    whole blocks: the worker writes the forwarded rows into every prompt sharing them as they
    come, so nothing is copied from the row store afterwards."""
    gen = VllmHiddenStatesGenerator(llm)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    prompts = [SHARED * 3 + "3 * 4 =", SHARED * 3 + "the mat is", "red cat"]  # 2 blocks shared
    res = gen.generate(prompts, SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3))
    st = res.stats
    assert st.prefix_cache_rows >= 2 * 32 and st.rows_from_shared_prefix == st.prefix_cache_rows
    assert st.rows_shared == sum(2 * len(per[0].prompt_token_ids) for per in res.hidden_states)
    assert st.rows_from_store == 0 and st.rows_recomputed == 0 and st.rows_placed == st.rows_captured
    check_all(model_path, res)


def test_a_prompt_that_is_whole_blocks_of_another_shares_them_at_an_equal_limit(llm, model_path):
    gen = VllmHiddenStatesGenerator(llm)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    ids = gen.tokenizer(SHARED * 4)["input_ids"]
    assert len(ids) > 70
    prompts = [{"prompt_token_ids": ids[:64]}, {"prompt_token_ids": ids[:70]}]  # 2 whole 32-token blocks
    res = gen.generate(prompts, SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=5))
    st = res.stats
    assert st.prefix_cache_rows > 0 and st.rows_from_shared_prefix == st.prefix_cache_rows
    assert st.rows_from_store == 0 and st.rows_recomputed == 0
    check_all(model_path, res)


def test_compute_last_token_adds_the_final_row(llm, model_path):
    gen = VllmHiddenStatesGenerator(llm)
    res = gen.generate([SHARED + "3 * 4 ="], SamplingParams(max_tokens=5, temperature=0.0), compute_last_token=True)
    s = res.hidden_states[0][0]
    assert s.hidden.shape[0] == len(s.token_ids)
    assert_rows_match(model_path, s.token_ids, s.hidden, LAYERS, 1e-4)
    assert res.stats.rows_recomputed >= 1


def test_generate_under_inference_mode_writes_validity_and_stores_rows(llm, model_path):
    """Callers often run under ``torch.inference_mode()``; the call still marks rows valid in place
    (the last row, the store's fill) and its stored rows serve the next call."""
    gen = VllmHiddenStatesGenerator(llm)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    with torch.inference_mode():
        first = gen.generate([SHARED * 3 + "3 * 4 ="], SamplingParams(max_tokens=4, temperature=0.0),
                             compute_last_token=True)
        again = gen.generate([SHARED * 3 + "5 + 6 ="], SamplingParams(max_tokens=4, temperature=0.0))
    assert first.stats.rows_recomputed >= 1 and again.stats.rows_from_store > 0
    s = first.hidden_states[0][0]
    assert_rows_match(model_path, s.token_ids, s.hidden, LAYERS, 1e-4)
    check_all(model_path, again)


def test_chat_prompts_render_thinking_switch(llm, tiny_models):
    chat = [{"role": "user", "content": "3 * 4 ="}]
    off = VllmHiddenStatesGenerator(llm, enable_thinking=False).render_prompt(chat)[1]
    on = VllmHiddenStatesGenerator(llm, enable_thinking=True).render_prompt(chat)[1]
    assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")
    res = VllmHiddenStatesGenerator(llm).generate([chat], SamplingParams(max_tokens=4, temperature=0.0))
    assert res.hidden_states[0][0].prompt == off
    assert res.hidden_states[0][0].prompt_token_ids == list(res.outputs[0].prompt_token_ids)


def test_bad_prompts_fail_clearly(llm):
    gen = VllmHiddenStatesGenerator(llm)
    with pytest.raises(ValueError, match="empty"):
        gen.generate(["ok", "   "], SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="expected str"):
        gen.generate([42], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="sampling params"):
        gen.generate(["a", "b"], [SamplingParams(max_tokens=2)])
    res = gen.generate(["still works"], SamplingParams(max_tokens=2))
    assert res.hidden_states[0][0].output_token_ids


def test_wraps_lm_polygraph_whitebox_model(llm, model_path):
    from lm_polygraph.model_adapters.whitebox_model_vllm import WhiteboxModelvLLM

    wb = WhiteboxModelvLLM(llm, SamplingParams(max_tokens=5))
    gen = VllmHiddenStatesGenerator(wb)
    res = gen.generate(["5 + 6 ="])  # sampling params come from the wrapper
    assert len(res.hidden_states[0][0].output_token_ids) <= 5
    check_all(model_path, res)
    with pytest.raises(KeyError, match="not captured"):
        res.hidden_states[0][0].layer(1)
    assert torch.equal(res.hidden_states[0][0].layer(2), res.hidden_states[0][0].hidden[:, 1])


def test_blocks_cached_by_plain_requests_cost_no_second_pass(llm, model_path):
    """A plain ``llm.generate`` on the same engine leaves prompt blocks in vLLM's prefix cache whose
    rows nobody recorded. Captured requests have their own cache namespace (a fixed cache_salt), so
    they forward those prompts once, share them during the pass and recompute nothing."""
    gen = VllmHiddenStatesGenerator(llm)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    prompts = [SHARED * 3 + "3 * 4 =", SHARED * 3 + "the mat is"]
    plain = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    again = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert min(o.num_cached_tokens for o in again) >= 64 > 0 == plain[0].num_cached_tokens  # the blocks are cached
    res = gen.generate(prompts, SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3))
    st = res.stats
    assert st.rows_recomputed == 0 and st.recompute_requests == 0 and st.rows_from_store == 0
    assert st.prefix_cache_rows > 0 and st.rows_from_shared_prefix == st.prefix_cache_rows  # samples share
    check_all(model_path, res)


def test_text_prompts_reach_vllm_as_the_token_ids_vllm_would_make(llm, model_path):
    """The generator tokenizes text prompts once per prompt (not once per sample inside vLLM): the
    ids, the greedy outputs and the prompt text vLLM reports equal a plain ``llm.generate`` of the
    text."""
    gen = VllmHiddenStatesGenerator(llm)
    prompts = ["The cat sat on", SHARED + "2 + 2 ="]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    plain = llm.generate(prompts, greedy, use_tqdm=False)
    res = gen.generate(prompts, greedy)
    for p, a, b in zip(prompts, plain, res.outputs):
        assert b.prompt == p == a.prompt and list(b.prompt_token_ids) == list(a.prompt_token_ids)
        assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids)
    check_all(model_path, res)


def test_a_prompts_cache_salt_keeps_kv_blocks_rows_and_steps_apart(llm, model_path):
    """A prompt's ``cache_salt`` (a client's, as vLLM isolates clients): a salted request never gets
    KV blocks, stored rows or step histories of another salt, nor an unsalted one salted ones;
    requests of the same salt share them."""
    gen = VllmHiddenStatesGenerator(llm, step_cache_max_idle=8)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)

    def run(salt, text):  # a TextPrompt with the client's salt
        return gen.generate([{"prompt": text, **({"cache_salt": salt} if salt else {})}], greedy)

    first = run("a", SHARED * 3 + "3 * 4 =").hidden_states[0][0]
    continued = first.prompt + first.text  # the next step of that candidate
    for salt in ("b", None):
        assert len(run(salt, continued).hidden_states[0][0].steps) == 1  # no history of salt "a"
    assert [s.text for s in run("a", continued).hidden_states[0][0].steps][0] == first.text
    other = "the dog ran away from the red cat and 5 + 6 = 11. " * 3
    assert run("a", other).stats.prefix_cache_rows == 0
    for salt in ("b", None):
        res = run(salt, other)
        assert (res.stats.prefix_cache_rows, res.stats.rows_from_store, res.stats.rows_recomputed) == (0, 0, 0)
        check_all(model_path, res)
    again = run("a", other)
    assert again.stats.prefix_cache_rows > 0 and again.stats.rows_from_store > 0
    check_all(model_path, again)


def check_window(model_path, res, window) -> int:
    """Every sample's rows start at its window's start and equal HF's there; the generated rows and
    the last step are the same rows for every window. Returns the rows in the windows."""
    n = 0
    for per in res.hidden_states:
        for s in per:
            p = s.prompt_len
            first = {"all": 0, "generated": p}.get(window, max(p - window, 0) if isinstance(window, int) else -1)
            assert s.first_row == first and s.hidden.shape[0] == len(s.token_ids) - 1 - first
            assert_rows_match(model_path, s.token_ids, s.hidden, LAYERS, 1e-4, first_row=first)
            assert torch.equal(s.generated_rows(), s.hidden[p - first :]) and s.generated_rows().shape[0] == len(
                s.output_token_ids) - 1
            assert torch.equal(s.steps[-1].hidden, s.generated_rows()) and torch.equal(s.layer(2), s.hidden[:, 1])
            n += s.hidden.shape[0]
    return n


def test_capture_windows_return_exact_rows_and_never_copy_rows_outside(llm, model_path):
    """window="generated" / k / "all" with n=3 and prompts sharing blocks: rows equal HF's inside
    each window; the worker records only window rows (captured + skipped = forwarded; with the
    generated window exactly the generated rows); a prefix-cache hit on the prompt needs neither
    the row store nor a recompute for the generated window, and only window rows for k; the step
    cache continues a candidate of a windowed call."""
    gen = VllmHiddenStatesGenerator(llm)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    prompts = [SHARED * 3 + "3 * 4 =", SHARED * 3 + "the mat is"]
    sp = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=3)
    row_bytes = len(LAYERS) * gen.hidden_size * 4

    cold = gen.generate(prompts, sp, window="generated")  # nothing cached: every prompt row is skipped
    st = cold.stats
    generated = sum(len(s.output_token_ids) - 1 for per in cold.hidden_states for s in per)
    assert check_window(model_path, cold, "generated") == generated == st.rows_captured
    assert st.rows_skipped >= sum(len(per[0].prompt_token_ids) for per in cold.hidden_states)
    assert st.tokens_forwarded == st.rows_captured + st.rows_skipped and st.bytes_to_host == st.rows_captured * row_bytes
    assert (st.prefix_cache_rows, st.rows_from_store, st.rows_recomputed, st.rows_from_shared_prefix) == (0, 0, 0, 0)

    full = gen.generate(prompts, sp)  # "all": unchanged; vLLM serves the prompts' blocks, no rows stored for them
    st = full.stats  # skipped: the prompt rows the other samples forwarded (sample 0's are theirs)
    assert check_window(model_path, full, "all") > 0 and st.rows_shared > 0 and st.rows_recomputed > 0
    assert st.bytes_to_host == (st.tokens_forwarded - st.rows_skipped) * row_bytes

    hit = gen.generate(prompts, sp, window="generated")  # the prompts' blocks cached: nothing to fill
    st = hit.stats
    assert check_window(model_path, hit, "generated") == st.rows_captured
    assert (st.prefix_cache_rows, st.rows_from_store, st.rows_recomputed, st.recompute_requests) == (0, 0, 0, 0)

    k = gen.generate(prompts, sp, window=40)  # 40 prompt rows: cached blocks among them come from the store
    st = k.stats
    inside = check_window(model_path, k, 40)
    assert st.rows_from_store > 0 and st.rows_recomputed == 0 and st.rows_skipped > 0
    assert st.rows_captured + st.rows_from_store + st.rows_from_shared_prefix + st.rows_shared == inside

    starved = VllmHiddenStatesGenerator(llm, store_max_bytes=1, window=40)  # window per generator
    st = starved.generate(prompts, sp).stats  # recomputed through the held rows, only inside the windows
    assert st.rows_recomputed > 0 and st.rows_from_store == 0 and st.rows_skipped > 0
    assert st.bytes_to_host == (st.tokens_forwarded - st.rows_skipped) * row_bytes

    s = hit.hidden_states[0][1]
    nxt = gen.generate([s.prompt + s.text], SamplingParams(max_tokens=4, temperature=0.0), window="generated")
    check_window(model_path, nxt, "generated")
    steps = nxt.hidden_states[0][0].steps
    assert [r.text for r in steps[:-1]] == [s.text] and torch.equal(steps[0].hidden, s.generated_rows())
    with pytest.raises(ValueError, match="window"):
        gen.generate(prompts, sp, window="prompt")


def test_the_samples_of_a_prompt_share_one_copy_of_its_rows(llm, model_path):
    """n=3: sample 0 records the prompt's rows, the others only their own; every sample's prompt
    part is a view of that one copy (equal storage), ``hidden`` is prompt part + own part and
    equals HF's, for the window "all" and k prompt rows. A second call gets the prompt's rows from
    the store once per prompt, not per sample; a strict call continuing sample 2 finds its block
    across the prompt's end in the store."""
    gen = VllmHiddenStatesGenerator(llm)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    prompts = [SHARED * 3 + "3 * 4 =", "red cat"]  # no block shared across the prompts
    sp = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5)
    row_bytes = len(LAYERS) * gen.hidden_size * 4
    for window in ("all", 10, "all"):
        res = gen.generate(prompts, sp, window=window)
        st = res.stats
        check_window(model_path, res, window)
        held, shared = 0, 0
        for per in res.hidden_states:
            s0 = per[0]
            for s in per:
                assert s.prompt_rows.data_ptr() == s0.prompt_rows.data_ptr()
                assert s.prompt_rows.untyped_storage().data_ptr() == s0.prompt_rows.untyped_storage().data_ptr()
                assert s.generated_rows().data_ptr() == s.own_rows.data_ptr()
                assert torch.equal(s.hidden, torch.cat([s.prompt_rows, s.own_rows]))
                held += s.own_rows.shape[0] + (s.prompt_rows.shape[0] if s is s0 else 0)
                shared += 0 if s is s0 else s.prompt_rows.shape[0]
        assert st.rows_shared == shared > 0 and st.rows_from_shared_prefix == 0
        if st.prefix_cache_rows == 0:  # the first call: each row recorded once, by the sample holding it
            assert st.rows_captured == held and st.rows_recomputed == st.rows_from_store == 0
        else:  # cached prompts: their rows from the store, once per prompt
            assert 0 < st.rows_from_store <= sum(per[0].prompt_rows.shape[0] for per in res.hidden_states)
        assert st.bytes_to_host == (st.tokens_forwarded - st.rows_skipped) * row_bytes
    gen.strict = True  # a prefix-cache gap the store cannot fill would raise
    s = res.hidden_states[0][2]
    nxt = gen.generate([s.prompt + s.text], SamplingParams(max_tokens=4, temperature=0.0))
    assert nxt.stats.prefix_cache_rows > 0 and nxt.stats.rows_recomputed == 0
    check_all(model_path, nxt)
