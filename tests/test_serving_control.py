"""Per-step control while a request runs, on the session server (the plugin form) with the real
``openai`` client: ``stop_above`` aborts a choice in vLLM once a completed step's P(wrong) reaches
it, streamed or not, without stopping its siblings; ``keep_below`` keeps the choices under it.

Thresholds come from a reference run of the same request without them (greedy, or seeded for
n>1: child i samples with seed + i), so each test knows which choice must stop at which step.
``ignore_eos`` makes every choice that is not stopped run to ``max_tokens`` exactly. The tiny
model's text is noise; for n>1 a bias towards its newline token makes its lines (steps) short.
"""

from __future__ import annotations

import time
import urllib.request

import pytest

from uhead_vllm.client import UncertaintyClient

pytestmark = pytest.mark.slow  # every test here starts an engine, a server or a cluster

Q = "Write three short lines about the sea, one per line."
MAX_TOKENS = 48
NEWLINE = "201"  # the tiny model's "\n" token


def chat(client, n: int = 1, stream: bool = False, max_tokens: int = MAX_TOKENS, **unc):
    """The test's request: greedy for n=1, seeded sampling with short lines for n>1, ``unc`` added
    to ``uncertainty``."""
    sampling = dict(temperature=1.0, seed=0, logit_bias={NEWLINE: 4}) if n > 1 else dict(temperature=0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": Q}], n=n,
                                          max_tokens=max_tokens, stream=stream, **sampling,
                                          extra_body={"ignore_eos": True, "uncertainty": unc or True})


def engine_running(server) -> float:
    """vLLM's own gauge of the sequences its scheduler runs (Prometheus ``/metrics``)."""
    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    [line] = [x for x in lines if x.startswith("vllm:num_requests_running{")]
    return float(line.rsplit(" ", 1)[1])


def collect(stream) -> dict[int, dict]:
    """A stream's choices: text, finish_reason, the steps of mid-stream chunks (with how many content
    chunks had arrived when each came) and the final uncertainty object."""
    out: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            d = out.setdefault(c.index, {"text": "", "chunks": 0, "streamed": [], "final": None, "finish": None})
            if c.delta.content:
                d["text"] += c.delta.content
                d["chunks"] += 1
            unc = (c.model_extra or {}).get("uncertainty")
            if c.finish_reason is not None:
                d["finish"], d["final"] = c.finish_reason, unc
            elif unc:
                assert "error" not in unc, unc
                d["streamed"] += [(s, d["chunks"]) for s in unc["steps"]]
    return out


def running_max(unc: dict) -> float | None:
    """The largest P(wrong) among the steps that complete while a choice runs (all but its last)."""
    scores = [s["p_wrong"] for s in unc["steps"][:-1] if s["p_wrong"] is not None]
    return max(scores) if scores else None


def first_reaching(unc: dict, limit: float) -> int:
    return next(k for k, s in enumerate(unc["steps"][:-1]) if s["p_wrong"] is not None and s["p_wrong"] >= limit)


def counters(server) -> dict:
    return server.get_json("/uhead/status")


def test_stop_above_aborts_the_choice_at_the_step_that_reaches_it(client, server):
    """n=1, non-streamed and streamed: a threshold below the first step's P(wrong) ends the answer
    right after its first step, with the same first step and score as the run without it. vLLM
    ended the sequence: fewer tokens than ``max_tokens`` under ``ignore_eos``, and its scheduler
    runs nothing right after the answer (an abort on the API side only would leave the engine
    making the rest of the 400 tokens for seconds)."""
    ref = chat(client).choices[0]
    want = ref.model_extra["uncertainty"]
    assert ref.finish_reason == "length" and len(want["steps"]) >= 2, want["steps"]  # the first step completes
    first = want["steps"][0]
    limit = first["p_wrong"] / 2
    before = counters(server)
    res = chat(client, max_tokens=400, stop_above=limit)
    deadline = time.monotonic() + 1.5
    while engine_running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_running(server) == 0
    [c] = res.choices
    unc = c.model_extra["uncertainty"]
    assert c.finish_reason == "stop_above" and unc["stopped_by"] == "stop_above" and unc["stop_step"] == 0
    assert first["token_end"] < res.usage.completion_tokens < first["token_end"] + 16
    assert unc["steps"][0] == first and c.message.content.startswith(first["text"])
    assert unc["answer_p_wrong"] >= limit
    after = counters(server)
    assert after["stopped_choices"] == before["stopped_choices"] + 1
    assert after["aborted_choices"] == before["aborted_choices"] + 1  # the live sequence was aborted in vLLM

    [s] = collect(chat(client, stream=True, stop_above=limit)).values()
    assert s["finish"] == "stop_above" and s["final"]["stop_step"] == 0 and s["final"]["steps"][0] == first
    assert s["text"] == "".join(st["text"] for st in s["final"]["steps"])
    [(step, chunks)] = s["streamed"]  # the first step's score came mid-stream, as soon as it was complete
    assert step == first and chunks <= first["token_end"] + 1
    assert s["final"]["steps"][-1]["token_end"] < MAX_TOKENS
    final = counters(server)
    assert final["aborted_choices"] == after["aborted_choices"] + 1
    assert final["running_requests"] == 0 and final["server_bytes_held"] == 0

    [typed] = UncertaintyClient(server.url, model="tiny").chat(Q, max_tokens=400, stop_above=limit,
                                                                  extra_body={"ignore_eos": True})
    assert typed.finish_reason == "stop_above" and typed.stopped_step == 0 and typed.steps[0].p_wrong == first["p_wrong"]


def test_stop_above_stops_only_the_choices_that_reach_it(client):
    """n=3 seeded, non-streamed and streamed: a threshold between the choices' step scores stops the
    choices whose step reaches it, at that step; the others run to ``max_tokens``."""
    ref = chat(client, n=3).choices
    highs = {c.index: running_max(c.model_extra["uncertainty"]) for c in ref}
    scored = sorted(v for v in highs.values() if v is not None)
    assert len(set(scored)) >= 2, highs  # two choices with complete steps and different scores
    limit = (scored[0] + scored[-1]) / 2
    stops = {i: first_reaching(ref[i].model_extra["uncertainty"], limit) for i, v in highs.items()
             if v is not None and v >= limit}
    assert stops and len(stops) < 3
    res = chat(client, n=3, stop_above=limit)
    streamed = collect(chat(client, n=3, stream=True, stop_above=limit))
    for c in res.choices:
        unc, s = c.model_extra["uncertainty"], streamed[c.index]
        want = ref[c.index].model_extra["uncertainty"]
        if c.index in stops:
            k = stops[c.index]
            assert c.finish_reason == s["finish"] == "stop_above"
            assert unc["stop_step"] == s["final"]["stop_step"] == k
            assert unc["steps"][: k + 1] == s["final"]["steps"][: k + 1] == want["steps"][: k + 1]
            assert unc["steps"][-1]["token_end"] < MAX_TOKENS and s["final"]["steps"][-1]["token_end"] < MAX_TOKENS
        else:
            assert c.finish_reason == s["finish"] == "length" and "stopped_by" not in unc
            assert unc["steps"] == s["final"]["steps"] == want["steps"] and unc["steps"][-1]["token_end"] == MAX_TOKENS
    assert res.usage.completion_tokens < 3 * MAX_TOKENS


def test_keep_below_keeps_the_choices_under_it_or_the_best_one_flagged(client, server):
    """n=4 seeded: the response keeps exactly the choices whose answer P(wrong) is below the threshold
    (their own indices), lists the dropped ones; where none passes, the one with the lowest answer
    P(wrong), marked ``kept: false``. Streamed: every choice comes, its last chunk says ``kept``."""
    ref = {c.index: c.model_extra["uncertainty"]["answer_p_wrong"] for c in chat(client, n=4).choices}
    scores = sorted(ref.values())
    assert None not in scores and len(set(scores)) >= 2, ref
    limit = (scores[0] + scores[-1]) / 2
    res = chat(client, n=4, keep_below=limit)
    want = sorted(i for i, p in ref.items() if p < limit)
    assert [c.index for c in res.choices] == want and all(c.model_extra["uncertainty"]["kept"] for c in res.choices)
    dropped = res.model_extra["uncertainty"]["dropped"]
    assert res.model_extra["uncertainty"]["keep_below"] == limit
    assert sorted(d["index"] for d in dropped) == sorted(set(ref) - set(want))
    assert all(d["answer_p_wrong"] == pytest.approx(ref[d["index"]]) for d in dropped)

    none = chat(client, n=4, keep_below=scores[0] / 2)
    [best] = none.choices
    assert best.index == min(ref, key=ref.get) and best.model_extra["uncertainty"]["kept"] is False
    assert len(none.model_extra["uncertainty"]["dropped"]) == 3

    typed = UncertaintyClient(server.url, model="tiny").chat(
        Q, n=4, max_tokens=MAX_TOKENS, temperature=1.0, seed=0, logit_bias={NEWLINE: 4}, keep_below=limit,
        extra_body={"ignore_eos": True})
    assert [c.index for c in typed] == want and all(c.kept for c in typed)

    streamed = collect(chat(client, n=4, stream=True, keep_below=limit))
    assert sorted(streamed) == [0, 1, 2, 3]
    assert {i: s["final"]["kept"] for i, s in streamed.items()} == {i: p < limit for i, p in ref.items()}
