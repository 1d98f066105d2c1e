"""The embedded model with the shipped head, served: the typed client gets the same answers and
per-step scores as the offline main job (`uhead-vllm answer`) on the same questions."""

from __future__ import annotations

import io

import pytest

from serving_server import serve

pytestmark = pytest.mark.slow  # every test here starts an engine, a server or a cluster

QUESTIONS = ["What is 7 + 8?", "What is 45 + 38?", "What is 12 * 3?"]


def test_served_scores_equal_the_offline_main_job(embedded_model, tmp_path):
    from uhead_vllm.client import UncertaintyClient
    from uhead_vllm import answer

    for server in serve([], tmp_path / "server.log"):
        info = server.get_json("/uhead/info")
        client = UncertaintyClient(server.url, max_retries=0, timeout=300)
        served = [client.chat(info["prompt_template"].replace("{question}", q), max_tokens=info["max_tokens"])[0]
                  for q in QUESTIONS]
        status = server.get_json("/uhead/status")
    offline = answer(QUESTIONS, file=io.StringIO())
    assert status["head"] == "default" and status["captured_layers"] == [14, 18, 22]
    for s, o in zip(served, offline):
        assert s.text == o.text
        assert [st.text for st in s.steps] == [st.text for st in o.steps]
        assert s.answer_p_wrong == pytest.approx(o.uncertainty, abs=2e-2)
        for a, b in zip(s.steps, o.steps):
            assert (a.p_wrong is None) == (b.uncertainty is None)
            if a.p_wrong is not None:
                assert a.p_wrong == pytest.approx(b.uncertainty, abs=2e-2)
