"""The uncertainty server: a real server process on localhost, the real ``openai`` client.

One tiny-model server (serving_server.py's fixture: plain vLLM with the plugin, shared with the
other serving tests) serves the whole module (fp32 rows, layers 0/2/4 and five capture points, steering, prefix caching on, 32-token
blocks); returned rows are checked against Hugging Face's forward on the same ids (point columns:
HF forward hooks on the same modules).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load as st_load

from point_reference import hf_point_run
from reference import hf_rows, relative_error
from serving_server import HEAD_LAYERS, LAYERS

pytestmark = pytest.mark.slow  # every test here starts an engine, a server or a cluster

#: The canonical sites the server's --points name (serving_server.SERVER_POINTS), in column order.
SITES = [("attn_in", 0), ("attn_out", 1), ("mlp_out", 1), ("mlp_in", 3), ("mlp_out", 3)]
PREFIX = ("You are a careful calculator. Think line by line, write every step on its own line, and "
          "check each step twice before you give the final answer to the question below. ")


def rows_of(unc: dict) -> tuple[torch.Tensor, list[int]]:
    t = st_load(base64.b64decode(unc["rows"]["safetensors_b64"]))
    return t["hidden"], t["token_ids"].tolist()


def check_rows(model, unc: dict, layers=LAYERS, tol: float = 1e-4, points=()) -> int:
    """Rows (layers, then points) equal HF's forward (points: hooks on the same modules); returns
    their count. ``ERRORS`` keeps the largest error seen per kind of column."""
    hidden, ids = rows_of(unc)
    assert hidden.shape[0] == len(ids) and hidden.shape[1] == len(layers) + len(points)
    assert unc["rows"]["layers"] == list(layers) and unc["rows"]["points"] == [f"{p}.{k}" for p, k in points]
    ref = hf_point_run(model, ids, layers, points)[0] if points else hf_rows(model, ids, layers)
    err = relative_error(hidden, ref)
    assert err < tol, err
    _note("layers", relative_error(hidden[:, : len(layers)], ref[:, : len(layers)]) if layers else 0.0)
    if points:
        _note("points", relative_error(hidden[:, len(layers):], ref[:, len(layers):]))
    return hidden.shape[0]


ERRORS: dict[str, float] = {}


def _note(kind: str, err: float) -> None:
    ERRORS[kind] = max(ERRORS.get(kind, 0.0), err)


def chat(client, content: str, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


def test_chat_scores_each_step_and_plain_requests_are_untouched(client):
    plain = chat(client, "What is 2 + 3?", max_tokens=24, temperature=0)
    assert "uncertainty" not in (plain.choices[0].model_extra or {})
    res = chat(client, "What is 2 + 3?", max_tokens=24, temperature=0, extra_body={"uncertainty": True})
    assert res.choices[0].message.content == plain.choices[0].message.content
    unc = res.choices[0].model_extra["uncertainty"]
    assert unc["head"] == "tiny_head" and unc["steps"]
    assert unc["steps"][0]["token_start"] == 0 and unc["steps"][-1]["token_end"] == res.usage.completion_tokens
    assert all(a["token_end"] == b["token_start"] for a, b in zip(unc["steps"], unc["steps"][1:]))
    assert "".join(s["text"] for s in unc["steps"]) == res.choices[0].message.content
    scored = [s["p_wrong"] for s in unc["steps"] if s["p_wrong"] is not None]
    assert scored and all(0.0 <= p <= 1.0 for p in scored)
    assert unc["answer_p_wrong"] == pytest.approx(max(scored))
    assert res.choices[0].logprobs is None  # the head's logprobs stay inside the server


def test_features_are_the_heads_pooled_inputs_per_step(client, server, tiny_models, head_path):
    """Each step's ``features`` are the head's inputs pooled its way: the layer part equals the mean
    of Hugging Face's rows over the step's tokens, and the head on them gives the step's P(wrong)."""
    from uhead_vllm.features import FeatureRecipe, StepSpan, clip_span, step_token_features
    from uhead_vllm.heads import load_head

    model = tiny_models["llama"]
    res = chat(client, PREFIX + "What is 12 + 30?", max_tokens=24, temperature=0,
               extra_body={"uncertainty": {"features": True, "rows": {"layers": HEAD_LAYERS}}})
    unc = res.choices[0].model_extra["uncertainty"]
    head = load_head(head_path)
    _, ids = rows_of(unc)
    generated = hf_rows(model, ids, HEAD_LAYERS)[res.usage.prompt_tokens :]
    layers_only = FeatureRecipe(HEAD_LAYERS, "mean", 0)
    width = layers_only.token_dim(generated.shape[-1])
    checked = 0
    for step in unc["steps"]:
        span = clip_span(StepSpan(step["token_start"], step["token_end"]), 0, generated.shape[0])
        if span is None:
            assert step["features"] is None and step["p_wrong"] is None
            continue
        features = torch.tensor(step["features"])
        assert features.shape[0] == head.recipe.token_dim(generated.shape[-1])
        expected = step_token_features(generated, 0, span, layers_only, None, HEAD_LAYERS).mean(dim=0)
        assert relative_error(features[:width], expected) < 1e-4
        assert float(head.predict_proba([features.view(1, -1)])[0]) == pytest.approx(step["p_wrong"], abs=1e-6)
        checked += 1
    assert checked >= 1
    from uhead_vllm.client import UncertaintyClient

    [typed] = UncertaintyClient(server.url, max_retries=0).chat(PREFIX + "What is 12 + 30?", max_tokens=24,
                                                                features=True)
    assert [st.features for st in typed.steps] == [st["features"] for st in unc["steps"]]


def test_n_samples_each_get_their_own_rows(client, tiny_models):
    res = chat(client, PREFIX + "What is 7 + 8?", n=4, max_tokens=20, temperature=1.0, seed=3,
               extra_body={"uncertainty": {"rows": {"layers": LAYERS}}})
    texts = {c.message.content for c in res.choices}
    assert len(texts) > 1
    for c in res.choices:
        unc = c.model_extra["uncertainty"]
        hidden, ids = rows_of(unc)
        assert len(ids) == res.usage.prompt_tokens + unc["steps"][-1]["token_end"] - 1  # the last token has no row
        check_rows(tiny_models["llama"], unc)


def test_completions_several_prompts_and_n(client, tiny_models):
    prompts = [PREFIX + "2 + 2 =", PREFIX + "9 - 4 ="]
    res = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=12, temperature=1.0, seed=1,
                                    extra_body={"uncertainty": {"rows": {"layers": [0, 4]}}})
    assert len(res.choices) == 4
    firsts = set()
    for c in res.choices:
        unc = c.model_extra["uncertainty"]
        _, ids = rows_of(unc)
        firsts.add(tuple(ids[:5]))
        check_rows(tiny_models["llama"], unc, layers=[0, 4])
    assert len(firsts) == 1  # both prompts share the prefix; the rows still differ per choice


def test_streaming_sends_step_scores_then_the_same_final_scores(client):
    kw = dict(max_tokens=40, temperature=0, extra_body={"uncertainty": True})
    full = chat(client, PREFIX + "Count to five.", **kw).choices[0].model_extra["uncertainty"]
    streamed_steps, final, text = [], None, ""
    for chunk in chat(client, PREFIX + "Count to five.", stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            unc = (c.model_extra or {}).get("uncertainty")
            if unc and c.finish_reason is None:
                streamed_steps += unc["steps"]
            elif unc:
                final = unc
    assert final is not None and final["steps"] == full["steps"]
    assert final["answer_p_wrong"] == pytest.approx(full["answer_p_wrong"])
    # every step streamed before the end is the final one (all but the still-open last step)
    assert streamed_steps == full["steps"][: len(streamed_steps)]
    if len(full["steps"]) > 1:
        assert len(streamed_steps) >= 1


def test_prompts_cached_by_plain_requests_need_no_store_or_recompute(client, server, tiny_models):
    """A plain request leaves its prompt blocks in vLLM's prefix cache without rows; a request with
    uncertainty has its own cache namespace, so it forwards that prompt itself: no rows from the
    store, no recompute, rows equal HF. Its rows leave the worker through a shared-memory file
    (the generator's transport), none as bytes."""
    q = "A preamble no request with uncertainty has sent before, long enough for whole blocks. " * 3 + "8 + 5?"
    names = ("rows_from_store", "rows_recomputed", "rows_in_shared_memory", "rows_as_bytes")

    def counters() -> list[int]:
        status = server.get_json("/uhead/status")
        return [status[k] for k in names]

    for _ in range(2):
        plain = chat(client, q, max_tokens=4, temperature=0)
    assert plain.usage.prompt_tokens > 64
    before = counters()
    res = chat(client, q, max_tokens=8, temperature=0, extra_body={"uncertainty": {"rows": {"layers": LAYERS}}})
    after = counters()
    assert after[:2] == before[:2]
    checked = check_rows(tiny_models["llama"], res.choices[0].model_extra["uncertainty"])
    assert checked > 64
    assert after[2] - before[2] >= checked and after[3] == before[3]


def test_concurrent_requests_with_shared_prefixes_never_mix_rows(client, server, tiny_models):
    """32 concurrent requests (chat and completions, n=1..3, streaming and not) over shared
    prefixes; every choice's rows equal HF's forward on that choice's own token ids."""
    jobs = []
    for i in range(32):
        q = f"{PREFIX * (1 + i % 2)}Question {i % 5}: what is {i} + {i % 7}?"
        jobs.append((i, q))

    def run(job):
        i, q = job
        body = {"uncertainty": {"rows": {"layers": LAYERS}}}
        if i % 3 == 2:
            r = client.completions.create(model="tiny", prompt=q, n=1 + i % 2, max_tokens=16, temperature=1.0,
                                          seed=i, extra_body=body)
            return [c.model_extra["uncertainty"] for c in r.choices]
        if i % 4 == 1:
            out: dict[int, dict] = {}
            for chunk in chat(client, q, n=2, max_tokens=16, temperature=1.0, seed=i, stream=True, extra_body=body):
                for c in chunk.choices:
                    if c.finish_reason is not None:
                        out[c.index] = c.model_extra["uncertainty"]
            return [out[k] for k in sorted(out)]
        r = chat(client, q, n=1 + i % 3, max_tokens=16, temperature=1.0, seed=i, extra_body=body)
        return [c.model_extra["uncertainty"] for c in r.choices]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, jobs))
    checked = 0
    for uncs in results:
        for unc in uncs:
            checked += check_rows(tiny_models["llama"], unc)
    assert checked > 32 * 60
    status = server.get_json("/uhead/status")
    assert status["rows_from_store"] + status["rows_recomputed"] > 0  # prefix-cached rows were filled
    assert status["running_requests"] == 0 and status["worker_bytes_held"] == 0


def test_capture_points_are_served_named_and_equal_hf_hooks(client, server, tiny_models):
    """Point columns come back after the layers, named (aliases resolved) in the order asked, equal
    to HF forward hooks on the same modules and ids: n=2 over a prefix-cached prompt, completions
    with every captured column (``rows: {}``), and the typed client asking for a point alone."""
    from uhead_vllm.client import UncertaintyClient, decode_rows

    model = tiny_models["llama"]
    sites = [("mlp_out", 3), ("attn_in", 0), ("attn_out", 1)]
    body = {"uncertainty": {"rows": {"layers": [0, 4], "points": ["mlp_out.3", ["pre_attn", 0], "post_attn.1"]}}}

    def filled() -> int:
        return sum(server.get_json("/uhead/status")[k] for k in ("rows_from_store", "rows_recomputed"))

    before = filled()
    for _ in range(2):  # prefix-cached prompt blocks: their rows come from the row store
        res = chat(client, PREFIX + "What is 4 + 9?", n=2, max_tokens=12, temperature=1.0, seed=5, extra_body=body)
        for c in res.choices:
            check_rows(model, c.model_extra["uncertainty"], layers=[0, 4], points=sites)
    assert filled() > before
    r = client.completions.create(model="tiny", prompt=PREFIX + "7 - 2 =", max_tokens=8, temperature=0,
                                  extra_body={"uncertainty": {"steps": False, "rows": {}}})
    check_rows(model, r.choices[0].model_extra["uncertainty"], layers=LAYERS, points=SITES)
    [typed] = UncertaintyClient(server.url, max_retries=0).chat(PREFIX + "What is 4 + 9?", max_tokens=8,
                                                                points=[("mlp_in", 3)])
    hidden, ids, columns = decode_rows(typed.rows)
    assert columns == ["mlp_in.3"] and hidden.shape == (len(ids), 1, 128)
    assert relative_error(hidden, hf_point_run(model, ids, [], [("mlp_in", 3)])[0]) < 1e-4
    assert server.get_json("/uhead/info")["captured_points"] == [f"{p}.{k}" for p, k in SITES]
    print(f"\nmax relative error vs HF so far: {ERRORS}")


def test_streamed_capture_points_equal_hf_hooks_and_the_unstreamed_answer(client, tiny_models):
    """Streaming with points: the chunk with ``finish_reason`` carries the rows (mid-stream chunks
    only steps), their point columns equal HF hooks, and text, steps and rows equal the same greedy
    request unstreamed (rows of a stream are made exact the same way, only at its end)."""
    model = tiny_models["llama"]
    sites = [("mlp_out", 3), ("attn_in", 0), ("attn_out", 1)]
    kw = dict(max_tokens=24, temperature=0,
              extra_body={"uncertainty": {"rows": {"layers": [0, 4], "points": ["mlp_out.3", "pre_attn.0",
                                                                                 "attn_out.1"]}}})
    q = PREFIX + "Count to four, one number per line."
    full = chat(client, q, **kw).choices[0]
    text, final, early = "", None, []
    for chunk in chat(client, q, stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            unc = (c.model_extra or {}).get("uncertainty")
            if unc and c.finish_reason is None:
                early.append(unc)
            elif unc:
                final = unc
    assert final is not None and "error" not in final and all(set(u) == {"steps"} for u in early)
    check_rows(model, final, layers=[0, 4], points=sites)
    want = full.model_extra["uncertainty"]
    assert text == full.message.content and final["steps"] == want["steps"]
    assert {k: v for k, v in final["rows"].items() if k != "safetensors_b64"} == \
        {k: v for k, v in want["rows"].items() if k != "safetensors_b64"}
    (hidden, ids), (want_hidden, want_ids) = rows_of(final), rows_of(want)
    assert ids == want_ids and relative_error(hidden, want_hidden) < 1e-6


def post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("unc, needle", [
    ("yes", "must be true or an object"),
    ({"steps": False, "features": True, "rows": {"layers": [0]}}, "they need 'steps'"),
    ({"stepz": True}, "unknown key"),
    ({"rows": {"layers": [1]}}, "not captured"),
    ({"rows": {"layers": [0]}, "max_bytes": 1000}, "budget exceeded"),
    ({"rows": {"points": ["mlp_out.2"]}}, "not captured by this server"),
    ({"rows": {"points": ["mlp_out"]}}, "'point.layer'"),
    # 8 tokens x 1 column x 128 x 4 bytes fit; the point's column makes it 2: the budget counts it
    ({"rows": {"layers": [0], "points": ["mlp_out.1"]}, "max_bytes": 8 * 128 * 4}, "2 column(s)"),
    ({"head": "other"}, "unknown head"),
    ({"max_bytes": 1 << 40}, "exceeds this server's limit"),
    ({"stop_above": 0}, "must be a number in (0, 1]"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, client, unc, needle):
    status, body = post(server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "uncertainty": unc})
    assert status == 400 and needle in body["error"]["message"], body
    status, body = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                                    "vllm_xargs": {"uhead_vllm": "1"}})
    assert status == 400 and "reserved" in body["error"]["message"]
    assert chat(client, "hi", max_tokens=4, extra_body={"uncertainty": True}).choices[0].model_extra["uncertainty"]


def test_client_disconnect_leaves_no_rows_behind(server, client):
    import httpx

    body = {"model": "tiny", "messages": [{"role": "user", "content": PREFIX}], "max_tokens": 200,
            "stream": True, "n": 2, "ignore_eos": True, "uncertainty": {"rows": {"layers": LAYERS}}}
    for _ in range(3):
        with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60) as r:
            for k, _line in enumerate(r.iter_lines()):
                if k > 10:
                    break  # leave mid-stream
    chat(client, "hi", max_tokens=4)  # let the engine step past the aborts
    import time

    for _ in range(50):
        status = server.get_json("/uhead/status")
        if status["running_requests"] == 0 and status["worker_bytes_held"] == 0:
            break
        time.sleep(0.2)
    assert status["running_requests"] == 0 and status["worker_bytes_held"] == 0, status
    assert status["server_bytes_held"] == 0


def test_steered_requests_get_steered_rows_and_tokens_and_plain_ones_stay_plain(tiny_models, client):
    """A ``steer`` field adds the vector in the engine: rows and greedy tokens equal HF with the
    same vector added by hooks, also when the prompt's blocks come from the (salted) caches the
    second time; the same prompt unsteered gets plain rows (no KV block or stored row shared)."""
    model = tiny_models["llama"]
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    vec = [((i % 7) - 3) * 0.05 for i in range(hidden)]
    term = {"point": "mlp_out", "layer": 1, "vector": vec, "scale": 8.0, "tokens": "all"}
    q = PREFIX + "What is 6 + 7?"
    want_rows = {"uncertainty": {"rows": {"layers": LAYERS, "points": [f"{p}.{k}" for p, k in SITES]}}}
    steered = [chat(client, q, max_tokens=10, temperature=0, extra_body={"steer": [term], **want_rows})
               for _ in range(2)]
    for res in steered:
        rows, ids = rows_of(res.choices[0].model_extra["uncertainty"])
        ref, logits = hf_point_run(model, ids, LAYERS, SITES, steer=[("mlp_out", 1, vec, 8.0, 0)])
        err = relative_error(rows, ref[: rows.shape[0]])  # point columns included: they see the steered stream
        assert err < 1e-4, err
        _note("steered", err)
        prompt_len = len(ids) + 1 - res.usage.completion_tokens  # the rows' ids lack the last sampled token
        assert logits[prompt_len - 1 : len(ids) - 1].argmax(-1).tolist() == ids[prompt_len:]  # greedy under steering
    assert steered[0].choices[0].message.content == steered[1].choices[0].message.content
    plain = chat(client, q, max_tokens=10, temperature=0, extra_body=want_rows)
    plain_rows, plain_ids = rows_of(plain.choices[0].model_extra["uncertainty"])
    assert relative_error(plain_rows, hf_point_run(model, plain_ids, LAYERS, SITES)[0]) < 1e-4
    first, _ = rows_of(steered[0].choices[0].model_extra["uncertainty"])
    n = min(first.shape[0], plain_rows.shape[0])
    assert not torch.allclose(first[:n, 2], plain_rows[:n, 2])  # the steering changed layer 2 onwards
    mlp_out_1 = len(LAYERS) + SITES.index(("mlp_out", 1))
    assert not torch.allclose(first[:n, mlp_out_1], plain_rows[:n, mlp_out_1])  # ... and the steered point
    print(f"\nmax relative error vs HF so far: {ERRORS}")


def test_bad_steering_is_a_400(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="generated"):
        chat(client, "Hi", max_tokens=2, extra_body={"steer": [{"point": "mlp_out", "layer": 1, "vector": [0.0] * 128,
                                                                 "tokens": "generated"}]})
    with pytest.raises(BadRequestError, match="layer 9 out of range"):
        chat(client, "Hi", max_tokens=2, extra_body={"steer": [{"point": "mlp_out", "layer": 9, "vector": [0.0]}]})
