"""``process_output_fn`` / ``process_target_fn`` for lm-polygraph's AccuracyMetric on arithmetic
answers (``configs/polygraph/arith_processing.py`` exposes them to polygraph_eval, which loads
that file by path)."""

from __future__ import annotations

from typing import Any

from ..scoring.arithmetic import extract_answer, normalize_number


def answer_from_output(text: str) -> str:
    """The final number of a free-form answer, normalised; "" when there is none (never matches)."""
    return extract_answer(text) or ""


def answer_from_target(target: Any) -> str:
    """Reference answer as a normalised number string (pandas may hand over an int)."""
    text = str(target).strip()
    return normalize_number(text) or text
