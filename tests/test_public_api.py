"""The public API is the small set the README documents, and nothing else leaks through ``*``."""

from __future__ import annotations

import re
from pathlib import Path

import uhead_vllm

README = Path(__file__).resolve().parents[1] / "README.md"


def test_star_import_gives_exactly_the_documented_names() -> None:
    namespace: dict = {}
    exec("from uhead_vllm import *", namespace)
    exported = {k for k in namespace if not k.startswith("__")}
    assert exported == set(uhead_vllm.__all__)
    section = README.read_text().split("## Public API", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    documented = set(re.findall(r"`([A-Za-z_]+)`", "\n".join(rows)))
    assert documented == exported, (sorted(documented - exported), sorted(exported - documented))


def test_the_public_api_fits_in_a_head() -> None:
    """At most 20 names at the top; the rest is imported from the subpackage that owns it."""
    assert 10 <= len(uhead_vllm.__all__) <= 20
    assert len(set(uhead_vllm.__all__)) == len(uhead_vllm.__all__)
