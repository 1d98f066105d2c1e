"""Worker-side capture: every captured row equals Hugging Face's forward on the same token ids.

Covers eager and compiled mode, in-process and multiprocess engines, chunked prefill splitting a
long prompt, four samples of one prompt, layers 0 / middle / last, fp32 and bf16 storage.
"""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from vllm import SamplingParams

from capture_checks import check_raw_rows, layers_for
from reference import BF16_TOL, FP32_TOL, assert_rows_match, hf_rows, relative_error
from conftest import make_vllm_kwargs
from uhead_vllm.capture.protocol import RequestTag
from uhead_vllm.generation import CaptureClient, CaptureError, CaptureNotInstalledError, VllmHiddenStatesGenerator, build_llm
from uhead_vllm.generation.backends import make_capture_client
from uhead_vllm.models import model_identity

pytestmark = pytest.mark.slow  # every test here starts an engine, a server or a cluster

LONG = "12 + 7 = 19 and the cat sat on the mat. " * 8  # > 64 tokens: split by chunked prefill


def run_tagged(llm, client, prompts, n=1, max_tokens=12, temperature=0.8):
    """Generate with explicit tags (tag = prompt*n + sample); return rows and sequences by tag."""
    inputs, params, tags = [], [], []
    for i, p in enumerate(prompts):
        for s in range(n):
            inputs.append(p)
            tags.append(i * n + s)
            params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                         extra_args=RequestTag(i * n + s, s).to_extra_args()))
    outs = llm.generate(inputs, params, use_tqdm=False)
    rows = client.fetch()
    seqs = {t: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for t, o in zip(tags, outs)}
    return rows, seqs


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def eager_engine(request, tiny_models):
    model = tiny_models[request.param]
    layers = layers_for(model)
    llm = build_llm(str(model), layers, **make_vllm_kwargs(max_num_batched_tokens=64))
    yield model, layers, llm
    del llm
    gc.collect()


def test_eager_rows_match_hf_with_chunked_prefill_and_four_samples(eager_engine):
    model, layers, llm = eager_engine
    client = CaptureClient(llm)
    assert client.settings.layers == layers
    rows, seqs = run_tagged(llm, client, [LONG, "3 * 4 = 12", "the mat is red"], n=4)
    assert rows.error is None
    firsts = check_raw_rows(model, seqs, rows.tags, rows.positions, rows.token_ids, rows.hidden, layers, FP32_TOL)
    # Fresh engine: of each prompt's four samples, at least one computed the prompt from position
    # 0; the short prompts (no full 32-token block) cannot be served from the prefix cache at all.
    for i in range(3):
        assert min(firsts[4 * i + s] for s in range(4)) == 0
    assert all(firsts[t] == 0 for t in range(4, 12))
    # Chunked prefill: the long prompt's first sample arrives in several prompt chunks.
    chunks = [c for c in rows.chunks() if c[0] == 0 and c[2].numel() > 1]  # prefill chunks
    assert len(chunks) >= 2, "long prompt was not split by chunked prefill"
    # Every sample has its own generated rows, attributed to its sample index.
    for t, seq in seqs.items():
        m = rows.tags == t
        assert set(rows.samples[m].tolist()) == {t % 4}
        assert int(rows.positions[m].max()) == len(seq) - 2  # last sampled token is never forwarded


def test_untagged_requests_are_not_recorded(eager_engine):
    _, _, llm = eager_engine
    client = CaptureClient(llm)
    llm.generate(["the cat sat"], SamplingParams(max_tokens=4), use_tqdm=False)
    rows = client.fetch()
    assert rows.num_rows == 0 and rows.error is None
    assert rows.stats["forwards_seen"] > 0 and rows.stats["forwards_recorded"] == 0


def test_shared_tag_from_direct_n_gt_1_is_reported(eager_engine):
    _, _, llm = eager_engine
    client = CaptureClient(llm)
    llm.generate(["the cat"], SamplingParams(n=2, max_tokens=3, extra_args=RequestTag(7).to_extra_args()),
                 use_tqdm=False)
    rows = client.fetch()
    assert rows.error and "same capture tag" in rows.error


def test_forged_tags_never_stop_the_engine_nor_touch_other_requests_rows(eager_engine):
    """Nothing a client sends can stop ``execute_model``: tags that do not parse are counted and
    their requests run untagged; while a generation writes into a destination, a tag its slots did
    not announce is counted and writes nothing. The honest request's rows stay exact either way."""
    model, layers, llm = eager_engine
    client = CaptureClient(llm)
    before = client.status()
    forged = [{"uhead_vllm": "1"}, {"uhead_vllm": {"tag": "7"}}, {"uhead_vllm": {"tag": 1 << 63}},
              {"uhead_vllm": {"tag": 3, "sample": True}}]
    prompt = "the forged tags came first, then the honest one"
    params = [SamplingParams(max_tokens=4, temperature=0.0, extra_args=x) for x in forged]
    params.append(SamplingParams(max_tokens=6, temperature=0.0, extra_args=RequestTag(3, 0).to_extra_args()))
    outs = llm.generate(["the cat sat on the mat"] * len(forged) + [prompt], params, use_tqdm=False)
    rows = client.fetch()
    assert rows.error is None and set(rows.tags.tolist()) == {3}
    seq = list(outs[-1].prompt_token_ids) + list(outs[-1].outputs[0].token_ids)
    check_raw_rows(model, {3: seq}, rows.tags, rows.positions, rows.token_ids, rows.hidden, layers, FP32_TOL)
    # A generation writing into a destination announces its tags (the slots): tag 99 was not.
    capacity, hidden_size = 40, model_identity(model)["hidden_size"]
    placement = client.place_into({5: (0, capacity)}, (capacity, len(layers), hidden_size))
    dest = placement.settle()
    honest = "an announced tag writes its own slot"
    outs = llm.generate([honest, honest + " and more"], [
        SamplingParams(max_tokens=5, temperature=0.0, extra_args=RequestTag(5, 0).to_extra_args()),
        SamplingParams(max_tokens=5, temperature=0.0, extra_args=RequestTag(99, 0).to_extra_args())],
        use_tqdm=False)
    placed = client.fetch()
    seq = list(outs[0].prompt_token_ids) + list(outs[0].outputs[0].token_ids)
    n = len(seq) - 1  # the last sampled token is never forwarded
    assert placed.error is None and placed.placed and placed.num_rows == n
    assert dest.tokens[:n].tolist() == seq[:n] and bool((dest.tokens[n:] == -1).all())
    assert relative_error(dest.buffer[:n], hf_rows(str(model), seq, layers)[:n]) < FP32_TOL
    after = client.status()
    assert after["tags_malformed"] - before["tags_malformed"] == len(forged)
    assert after["tags_unannounced"] - before["tags_unannounced"] == 1
    assert after["tags_duplicate"] == before["tags_duplicate"]


def test_one_capture_client_per_engine_chosen_once(eager_engine):
    """``make_capture_client`` picks the backend and transport once and keeps the client for the
    engine (holding the engine weakly); this engine's worker runs in this process."""
    _, layers, llm = eager_engine
    client = make_capture_client(llm)
    assert make_capture_client(llm) is client and client.llm is llm and client.settings.layers == layers
    assert client.transport.inline and client.status()["recording"]


def test_compiled_mode_rows_match_hf(tiny_models):
    model = tiny_models["llama"]
    layers = layers_for(model)
    llm = build_llm(str(model), layers, **make_vllm_kwargs(enforce_eager=False, max_num_batched_tokens=64))
    client = CaptureClient(llm)
    rows, seqs = run_tagged(llm, client, [LONG, "3 * 4 = 12"], n=4)
    check_raw_rows(model, seqs, rows.tags, rows.positions, rows.token_ids, rows.hidden, layers, 1e-4)
    del llm, client
    gc.collect()


@pytest.mark.multiproc
def test_multiprocess_rows_match_hf(multiprocess_run):
    """Engine core and worker in their own processes (qwen3, eager; compiled: the in-process test
    above and the GPU TP=2 test). The generator's calls run twice on the one engine: rows placed by
    the host placer, then written by the worker with the torch scatter a GPU runs
    (capture/file_writer.py), here on the CPU."""
    multiprocess_run.check_ran()
    model, layers, out = multiprocess_run.model, multiprocess_run.layers, multiprocess_run.rows
    t = load_file(str(out))
    seqs = {i: t[f"seq_{i}"].tolist() for i in range(3)}
    check_raw_rows(model, seqs, t["tags"], t["positions"], t["token_ids"], t["hidden"], layers, 1e-4)
    assert t["chunk_offsets"].numel() - 1 > 3 * 2  # prompt chunks + decode steps
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    for way in ("placer", "file-writer"):
        m = {k.split(".", 1)[1]: v for k, v in meta.items() if k.startswith(f"{way}.")}
        # The generator on the same engine: the worker placed its rows into shared memory.
        assert int(m["rows_placed"]) == int(m["rows_captured"]) > 0, way
        on_device = int(m["rows_placed"]) if way == "file-writer" else 0
        assert int(m["rows_written_on_device"]) == on_device, way
        assert (int(m["again_rows_written_on_device"]) > 0) == (way == "file-writer"), way
        assert int(m["rows_shared"]) > 0 and int(m["rows_from_store"]) == 0, way  # samples share the prompt rows
        # Shared row files: held rows stay as they were; a file is written again once nobody holds it.
        assert m["held_rows_unchanged"] == "True" and int(m["again_rows_placed"]) > 0, way
        # The destination is handed over without waiting for the worker's answer; a worker that
        # declines it (the file it sees is not the engine side's) answers after the requests ran,
        # and the rows come back with the fetch instead, still exact.
        assert m["declined_rows_placed"] == "0" and int(m["declined_rows_captured"]) > 0, way
        # Capture windows ("again": the last 3 prompt rows, "declined": generated rows only): rows
        # below them were skipped in the worker, the generated window's rows are exactly those returned.
        assert int(m["again_rows_skipped"]) > 0 and int(m["declined_rows_skipped"]) > 0, way
        assert m["declined_rows_captured"] == m["declined_generated_rows"], way
        for label in ("gen", "again", "declined"):
            keys = sorted(k[: -len("_ids")] for k in t if k.startswith(f"{way}/{label}_") and k.endswith("_ids"))
            assert len(keys) == 4, (way, label, keys)
            for key in keys:
                first, prompt_len = t[f"{key}_first"].tolist()
                assert first == {"gen": 0, "again": max(prompt_len - 3, 0), "declined": prompt_len}[label], key
                assert_rows_match(str(model), t[f"{key}_ids"].tolist(), t[f"{key}_hidden"], layers, FP32_TOL,
                                  first_row=first)
        if way == "placer":  # the first way starts without row files: two made while held, one reused after
            assert m["files_created_while_held"] == "2" and m["files_created"] == "2" and m["files_reused"] == "1"
        else:  # the second starts with the first way's files, let go: it writes into files used before
            assert int(m["files_reused"]) >= 2, m


def test_bf16_storage_rows_match_hf(tiny_models):
    model = tiny_models["qwen3"]
    layers = layers_for(model)
    llm = build_llm(str(model), layers, capture_dtype="bfloat16", **make_vllm_kwargs())
    client = CaptureClient(llm)
    rows, seqs = run_tagged(llm, client, ["3 * 4 = 12 and 5 + 5 = 10", "the mat is red"], n=2)
    assert rows.hidden.dtype == torch.bfloat16
    check_raw_rows(model, seqs, rows.tags, rows.positions, rows.token_ids, rows.hidden, layers, BF16_TOL)
    # Memory budget: a tiny per-call budget fails clearly and the engine keeps working.
    del llm, client
    gc.collect()


def test_memory_budget_fails_clearly_and_engine_survives(tiny_models):
    model = tiny_models["llama"]
    llm = build_llm(str(model), (0, 1), max_capture_bytes=20_000, **make_vllm_kwargs())
    gen = VllmHiddenStatesGenerator(llm)
    with pytest.raises(CaptureError, match="memory budget exceeded") as err:
        gen.generate([LONG], SamplingParams(max_tokens=8))
    assert err.value.outputs and err.value.outputs[0].outputs[0].token_ids  # vLLM's results kept
    res = gen.generate(["3 * 4"], SamplingParams(max_tokens=4))  # small request still fits
    assert res.hidden_states[0][0].hidden.shape[0] == len(res.hidden_states[0][0].token_ids) - 1
    del gen, llm
    gc.collect()


def test_unknown_layer_is_refused_at_setup(tiny_models):
    model = tiny_models["llama"]
    n = model_identity(model)["num_hidden_layers"]
    with pytest.raises(ValueError, match=rf"capture layers \[{n + 1}\] out of range: this model has {n} decoder layers"):
        build_llm(str(model), (0, n + 1), **make_vllm_kwargs())
    gc.collect()


def test_engine_without_extension_gives_clear_error(tiny_models):
    import vllm

    llm = vllm.LLM(model=str(tiny_models["llama"]), **make_vllm_kwargs())
    with pytest.raises(CaptureNotInstalledError, match="capture_engine_kwargs"):
        VllmHiddenStatesGenerator(llm)
    del llm
    gc.collect()


def test_embedded_model_rows_match_hf(embedded_model):
    layers = (0, 15, 30)
    llm = build_llm(str(embedded_model), layers, **make_vllm_kwargs(max_model_len=1024))
    gen = VllmHiddenStatesGenerator(llm)
    chats = [[{"role": "user", "content": q}] for q in ("What is 7 + 8?", "Name a colour.", "What is 45 + 38?")]
    res = gen.generate(chats, SamplingParams(max_tokens=24, temperature=0.0))
    from reference import assert_rows_match

    for per in res.hidden_states:
        s = per[0]
        assert len(s.output_token_ids) > 0
        assert_rows_match(embedded_model, s.token_ids, s.hidden, layers, 1e-4)
    del gen, llm
    gc.collect()
