"""The web page at ``/`` in a real headless browser (Debian's chromium, installed by scripts/setup.sh):
it asks the server, and the steps it renders carry the same P(wrong) the API returns."""

from __future__ import annotations

import colorsys
import html.parser
import re
import shutil
import subprocess
import urllib.parse

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup.sh installs it)")]


def _expected_rgb(p: float) -> list[float]:
    """The page's colour, hsl(120 * (1 - p), 70%, 85%), in 0-255 RGB."""
    return [255 * c for c in colorsys.hls_to_rgb(round(120 * (1 - p)) / 360, 0.85, 0.70)]


def _rgb(style: str) -> list[float]:
    m = re.search(r"rgb\((\d+), (\d+), (\d+)\)", style)
    assert m, style
    return [float(x) for x in m.groups()]


class _Steps(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.steps: list[dict] = []
        self.summary: str | None = None
        self.state: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and a.get("class") == "step":
            self.steps.append(a)
        if tag == "div" and a.get("id") == "summary":
            self.summary = a.get("data-p-wrong")
        if tag == "body":
            self.state = a.get("data-state")


def test_page_renders_steps_coloured_by_p_wrong(server, client, tmp_path):
    question = "What is 4 + 5?"
    url = f"{server.base}/?q={urllib.parse.quote(question)}"
    shot = tmp_path / "page.png"
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=60000"]
    subprocess.run([*common, f"--screenshot={shot}", "--window-size=1000,700", url], check=True,
                   capture_output=True, timeout=180)
    assert shot.stat().st_size > 5000
    dom = subprocess.run([*common, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=180).stdout
    parsed = _Steps()
    parsed.feed(dom)
    assert parsed.state == "done", dom[-2000:]
    info = server.get_json("/uhead/info")
    api = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": info["prompt_template"].replace("{question}", question)}],
        temperature=0, max_tokens=info["max_tokens"], extra_body={"uncertainty": True}).choices[0].model_extra["uncertainty"]
    assert len(parsed.steps) == len(api["steps"])
    for shown, step in zip(parsed.steps, api["steps"]):
        if step["p_wrong"] is None:
            assert shown["data-p-wrong"] == ""
            continue
        assert float(shown["data-p-wrong"]) == pytest.approx(step["p_wrong"], abs=1e-9)
        assert shown["title"] == f"P(wrong) = {step['p_wrong']:.3f}"
        assert _rgb(shown["style"]) == pytest.approx(_expected_rgb(step["p_wrong"]), abs=1.01)
    assert float(parsed.summary) == pytest.approx(api["answer_p_wrong"], abs=1e-9)
