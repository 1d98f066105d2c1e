"""Test helpers for study datasets."""

from __future__ import annotations

import json
from pathlib import Path

from uhead_vllm.study.data import ANSWERS_FILE, MANIFEST_FILE


def relabel(path: Path) -> None:
    """Alternate answer and step labels so both classes exist; keep the manifest consistent."""
    lines = []
    for i, line in enumerate((path / ANSWERS_FILE).read_text().splitlines()):
        rec = json.loads(line)
        rec["correct"] = i % 2 == 0
        for k, step in enumerate(rec["steps"]):
            step["label"] = (i + k) % 2
        lines.append(json.dumps(rec))
    (path / ANSWERS_FILE).write_text("\n".join(lines) + "\n")
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][ANSWERS_FILE] = (path / ANSWERS_FILE).stat().st_size
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
