"""The embedded model with the shipped head, served by two API server processes on one engine
(``--api-server-count 2``, as vLLM scales its front end) that reduce rows to the head's inputs in
the worker (``--scores-on-device``, the recommended serving flags): the typed client, asking
concurrently, gets the same answers and per-step scores as the offline main job (`uhead-vllm
answer`), which scores full rows on the host."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import pytest

from serving_server import serve

pytestmark = pytest.mark.slow  # every test here starts an engine, a server or a cluster

QUESTIONS = ["What is 7 + 8?", "What is 45 + 38?", "What is 12 * 3?"]


def test_served_scores_equal_the_offline_main_job(embedded_model, tmp_path):
    """Each question asked twice at once, in rounds until both API servers have scored requests:
    every answer equals the offline job's. A request for rows is refused (the worker keeps none):
    the scores came from the reduced inputs. Each round uses new connections (a client's kept
    connections stay with the process that accepted them; one busy or slow process may accept
    none of a round's)."""
    import openai

    from uhead_vllm.client import UncertaintyClient
    from uhead_vllm import answer

    served = []
    for server in serve(["--api-server-count", "2", "--scores-on-device"], tmp_path / "server.log"):
        info = server.get_json("/uhead/info")
        prompts = [info["prompt_template"].replace("{question}", q) for q in QUESTIONS] * 2
        for _ in range(8):
            client = UncertaintyClient(server.url, max_retries=0, timeout=300)
            with ThreadPoolExecutor(len(prompts)) as pool:
                served.append(list(pool.map(lambda p: client.chat(p, max_tokens=info["max_tokens"])[0], prompts)))
            with ThreadPoolExecutor(12) as pool:  # at once: an idle process may win every accept one at a time
                statuses = {s["process_id"]: s for s in pool.map(lambda _: server.get_json("/uhead/status"), range(48))}
            if all(s["row_take_callers"] > 0 for s in statuses.values()) and len(statuses) == 2:
                break
        with pytest.raises(openai.BadRequestError, match="reduces rows to the head's inputs"):
            client.chat(prompts[0], rows=[14], max_tokens=4)
        engine_time = next(iter(statuses.values()))["worker_engine_time"]
        assert engine_time["forwards_recorded"] > 0 and engine_time["tag_takes"] > 0
    assert len(statuses) == 2 and all(s["row_take_callers"] > 0 for s in statuses.values()), statuses
    offline = answer(QUESTIONS, file=io.StringIO())
    status = next(iter(statuses.values()))
    assert status["head"] == "default" and status["captured_layers"] == [14, 18, 22]
    for s, o in ((s, o) for round_ in served for s, o in zip(round_, offline * 2)):
        assert s.text == o.text
        assert [st.text for st in s.steps] == [st.text for st in o.steps]
        assert s.answer_p_wrong == pytest.approx(o.uncertainty, abs=2e-2)
        for a, b in zip(s.steps, o.steps):
            assert (a.p_wrong is None) == (b.uncertainty is None)
            if a.p_wrong is not None:
                assert a.p_wrong == pytest.approx(b.uncertainty, abs=2e-2)
