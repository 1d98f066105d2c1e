"""The README and the guides in docs/ are for users, not a lab notebook: no development history
(session or issue numbers, commit hashes outside links to results files), and a short README.
History goes to CHANGELOG.md and to the READMEs of the results folders."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 15 * 1024

#: What may name a commit: a link target, or a path into a results folder (runs are filed by commit).
RESULTS_REFERENCES = re.compile(r"\]\([^)\s]*\)|[\w./-]*results/[\w./{},*-]*")
HISTORY = {
    "session number": re.compile(r"\bsession\s+\d", re.IGNORECASE),
    "issue number": re.compile(r"\bissue\s*#?\d|(?<![\w&/#])#\d+\b", re.IGNORECASE),
    "commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
}


def history_in(text: str) -> list[tuple[str, str]]:
    """(kind, match) for every piece of development history in ``text``."""
    text = RESULTS_REFERENCES.sub(" ", text)
    return [(kind, m.group(0)) for kind, pattern in HISTORY.items() for m in pattern.finditer(text)]


def test_history_is_found_where_it_is_and_only_there() -> None:
    diary = "Since session 24 (issue #14, see #16) commit 3f45dcb and 36b5088e1f made it 2x faster."
    assert sorted({kind for kind, _ in history_in(diary)}) == sorted(HISTORY)
    assert len(history_in(diary)) == 5
    guide = ("Capture costs 0.953x ([results](experiments/results/gpu/rounds-2ded969-h100/)); log: "
             "`experiments/results/ci-51c8c96.log`. Numbers like 1234567, words like defaced, "
             "anchors like [x](#how-it-works) and headings like ## Tests are no history.")
    assert history_in(guide) == []


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_guides_carry_no_development_history(path: Path) -> None:
    assert history_in(path.read_text()) == []


def test_readme_is_a_short_guide() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}"
    assert (ROOT / "CHANGELOG.md").is_file() and (ROOT / "experiments" / "README.md").is_file()
