"""The web page at ``/`` in a real headless browser (Debian's chromium, installed by scripts/setup.sh)
against the session server: it streams n seeded answers in one request, and the cards it renders
carry the steps, P(wrong), finish reasons and the head's pick of the same request made with the
``openai`` client (child i samples with seed + i, so both see the same answers)."""

from __future__ import annotations

import colorsys
import fcntl
import html.parser
import json
import os
import re
import select
import shutil
import subprocess
import time
import urllib.parse

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup.sh installs it)")]

QUESTION = "Write three short lines about the sea, one per line."
N, SEED, TEMPERATURE = 4, 0, 1.0
#: The page's "more fields": the tiny model's text is noise; a bias towards its newline token makes lines (steps).
EXTRA = {"logit_bias": {"201": 4}, "max_tokens": 96}


def _expected_rgb(p: float) -> list[float]:
    """The page's colour, hsl(120 * (1 - p), 70%, 85%), in 0-255 RGB."""
    return [255 * c for c in colorsys.hls_to_rgb(round(120 * (1 - p)) / 360, 0.85, 0.70)]


def _rgb(style: str) -> list[float]:
    m = re.search(r"rgb\((\d+), (\d+), (\d+)\)", style)
    assert m, style
    return [float(x) for x in m.groups()]


class _Page(html.parser.HTMLParser):
    """The rendered DOM: the body's state, the status line and each card with its step spans."""

    def __init__(self, dom: str):
        super().__init__()
        self.state: str | None = None
        self.status = ""
        self.cards: list[dict] = []
        self._in_status = False
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "body":
            self.state = a.get("data-state")
        elif tag == "div" and a.get("id") == "status":
            self._in_status = True
        elif tag == "article" and "card" in classes:
            self.cards.append({**a, "steps": []})
        elif tag == "span" and "step" in classes:
            self.cards[-1]["steps"].append(a)

    def handle_endtag(self, tag):
        if tag == "div":
            self._in_status = False

    def handle_data(self, data):
        if self._in_status:
            self.status += data


class Chromium:
    """Headless chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    it reads commands on fd 3 and writes replies on fd 4, NUL-separated JSON), stdlib only.
    ``--dump-dom`` cannot wait for a streamed answer: its virtual time ends once the headers came."""

    def __init__(self):
        to_chrome, self._cmd = os.pipe()
        self._out, from_chrome = os.pipe()

        def wire() -> None:  # in the child: the pipe ends on fds 3 and 4 (lifted above them first)
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome, from_chrome)]
            for fd, target in zip(high, (3, 4)):
                os.dup2(fd, target)
                os.set_inheritable(target, True)

        self.proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                                      "--window-size=1300,900", "about:blank"], preexec_fn=wire, close_fds=False,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome)
        os.close(from_chrome)
        self._buf, self._id = b"", 0

    def send(self, method: str, session: str | None = None, timeout: float = 60, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._cmd, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                left = deadline - time.monotonic()
                assert left > 0 and select.select([self._out], [], [], left)[0], f"no reply to {method} in {timeout} s"
                chunk = os.read(self._out, 1 << 16)
                assert chunk, "chromium closed its pipe"
                self._buf += chunk
            line, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(line)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply
                return reply["result"]

    def close(self) -> None:
        try:  # let the browser end its own child processes
            os.write(self._cmd, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd)
        os.close(self._out)


#: Resolves with the page's DOM once it says it is done (or failed).
SETTLED = """new Promise(resolve => { const t = setInterval(() => {
  const s = document.body && document.body.dataset.state;
  if (s === "done" || s === "error") { clearInterval(t); resolve(document.documentElement.outerHTML); } }, 100); })"""


def browse(server, **params) -> _Page:
    """Open ``/?q=QUESTION&...`` (the page asks at once) and return the DOM once the answers are in."""
    query = {"q": QUESTION, "n": N, "seed": SEED, "temperature": TEMPERATURE, "extra": json.dumps(EXTRA), **params}
    browser = Chromium()
    try:
        target = browser.send("Target.createTarget", url="about:blank")
        session = browser.send("Target.attachToTarget", targetId=target["targetId"], flatten=True)["sessionId"]
        browser.send("Page.navigate", session, url=f"{server.base}/?{urllib.parse.urlencode(query)}")  # returns once committed
        dom = browser.send("Runtime.evaluate", session, timeout=180, expression=SETTLED, awaitPromise=True,
                           returnByValue=True)["result"]["value"]
    finally:
        browser.close()
    page = _Page(dom)
    assert page.state == "done", (page.state, page.status)
    return page


@pytest.fixture(scope="module")
def reference(server, client) -> list[dict]:
    """The page's request made with the ``openai`` client, unstreamed: each choice's finish_reason
    and uncertainty object, by index."""
    info = server.get_json("/uhead/info")
    res = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": info["prompt_template"].replace("{question}", QUESTION)}],
        n=N, temperature=TEMPERATURE, seed=SEED, **EXTRA, extra_body={"uncertainty": True})
    return [{"finish_reason": c.finish_reason, **c.model_extra["uncertainty"]}
            for c in sorted(res.choices, key=lambda c: c.index)]


def _p(attr: str) -> float | None:
    return None if attr == "" else float(attr)


def test_page_streams_n_answers_coloured_by_p_wrong_and_marks_the_heads_pick(server, reference):
    page = browse(server)
    assert [int(c["data-index"]) for c in page.cards] == list(range(N))
    for card, want in zip(page.cards, reference):
        assert card.get("data-finish-reason") == want["finish_reason"], card
        assert _p(card["data-answer-p-wrong"]) == pytest.approx(want["answer_p_wrong"], abs=1e-9)
        assert len(card["steps"]) == len(want["steps"]), (card, want)
        for shown, step in zip(card["steps"], want["steps"]):
            if step["p_wrong"] is None:
                assert shown["data-p-wrong"] == ""
                continue
            assert float(shown["data-p-wrong"]) == pytest.approx(step["p_wrong"], abs=1e-9)
            assert shown["title"] == f"P(wrong) = {step['p_wrong']:.3f}"
            assert _rgb(shown["style"]) == pytest.approx(_expected_rgb(step["p_wrong"]), abs=1.01)
        # steps were coloured while streaming: all but the last, save one that completes with the last token
        streamed = sum(s.get("data-streamed") == "1" for s in card["steps"])
        assert streamed >= len(want["steps"]) - 2, card
    assert sum(len(w["steps"]) >= 3 for w in reference) >= 2, reference  # the streaming check has steps to see
    scores = [w["answer_p_wrong"] for w in reference]
    assert None not in scores and len(set(scores)) == N, scores  # a pick that is right by chance is unlikely
    [pick] = [int(c["data-index"]) for c in page.cards if c.get("data-pick") == "1"]
    assert pick == min(range(N), key=scores.__getitem__)
    assert f"#{pick + 1}" in page.status


def stop_plan(reference: list[dict], margin: int) -> tuple[float, dict[int, int]] | None:
    """A ``stop_above`` between two step scores of the reference at which some answers but not all
    reach a complete step, each early enough that at least ``margin`` of its tokens follow the step
    after it (the abort must land before the answer ends; the plan with the most such tokens wins):
    the threshold and {answer: the step that reaches it}."""
    scores = sorted({s["p_wrong"] for w in reference for s in w["steps"][:-1] if s["p_wrong"] is not None})
    plans = []
    for low, high in zip(scores, scores[1:]):
        stops = {i: k for i, w in enumerate(reference)
                 for k in [next((k for k, s in enumerate(w["steps"][:-1]) if (s["p_wrong"] or 0) >= high), None)]
                 if k is not None}
        if 0 < len(stops) < len(reference):
            left = min(reference[i]["steps"][-1]["token_end"] - reference[i]["steps"][k + 1]["token_start"]
                       for i, k in stops.items())
            plans.append((left, (low + high) / 2, stops))
    best = max(plans, key=lambda p: p[0], default=None)
    return best[1:] if best is not None and best[0] >= margin else None


def test_page_stop_above_stops_the_answers_whose_step_reaches_it(server, reference):
    """A threshold between the answers' step scores: the cards of the answers that reach it end with
    finish_reason ``stop_above`` at that step, with the reference's scores up to it; the others are
    the reference's answers."""
    plan = stop_plan(reference, margin=32)
    assert plan is not None, reference  # the seeded answers give such a threshold
    limit, stops = plan
    page = browse(server, stop_above=limit)
    assert len(page.cards) == N
    for i, (card, want) in enumerate(zip(page.cards, reference)):
        shown = [_p(s["data-p-wrong"]) for s in card["steps"]]
        if i in stops:
            k = stops[i]
            assert card.get("data-finish-reason") == "stop_above", (card, k, limit)
            assert shown[: k + 1] == pytest.approx([s["p_wrong"] for s in want["steps"][: k + 1]], abs=1e-9)
        else:
            assert card.get("data-finish-reason") == want["finish_reason"], card
            assert shown == pytest.approx([s["p_wrong"] for s in want["steps"]], abs=1e-9)
            assert _p(card["data-answer-p-wrong"]) == pytest.approx(want["answer_p_wrong"], abs=1e-9)
