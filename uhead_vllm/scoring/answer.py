"""The main job: questions in, answers out, each with per-step and per-answer uncertainty from a head.

:func:`answer` is ``uhead-vllm answer`` (and ``uhead_vllm.answer``): it builds the engine for the
head's layers (:func:`~.recipe.build_job_generator`), answers and scores the questions in one call
(:mod:`.scored`) or in units of questions, here or on Ray actors (:mod:`.units`), and prints them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from .recipe import build_job_generator
from .scored import ScoredAnswer, answer_questions, check_questions
from .units import AnswerJob, answer_in_units


def format_table(answers: Sequence[ScoredAnswer], threshold: float = 0.5) -> str:
    """Readable report: per answer its P(wrong), then each step with its P(wrong)."""
    lines = []
    for i, a in enumerate(answers, 1):
        flag = "LIKELY WRONG" if a.uncertainty >= threshold else "likely right"
        lines.append(f"[{i}] {a.question.strip()}")
        lines.append(f"    answer: {a.extracted if a.extracted is not None else '(no number)'}   "
                     f"P(wrong) = {a.uncertainty:.3f}  ({flag})")
        lines.append("    step  P(wrong)  text")
        for k, s in enumerate(a.steps, 1):
            p = "   –   " if s.uncertainty is None else f"{s.uncertainty:7.3f}"
            text = " ".join(s.text.split())
            lines.append(f"    {k:>4}  {p}   {text[:100]}{'…' if len(text) > 100 else ''}")
        lines.append("")
    return "\n".join(lines)


def answer(questions: Sequence[str], head_dir: str | Path | None = None, *, model: str | None = None,
           max_tokens: int | None = None, threads: int | None = 1, as_json: bool = False,
           generator: Any = None, file: Any = None, allow_other_weights: bool = False,
           batch_size: int | None = None, ray: Any = None, engine: dict[str, Any] | None = None) -> list[ScoredAnswer]:
    """The main job: answer ``questions`` with the model and print per-step / per-answer P(wrong).

    ``head_dir``: a saved head (None: the shipped default head); ``model``: a local HF folder
    (None: the embedded model); ``generator``: an existing generator capturing the head's layers
    (None: one is built with :func:`build_job_generator`, ``engine`` replacing its settings).
    ``allow_other_weights`` accepts a head trained on other weights of the same model shape.
    ``batch_size``: questions per vLLM call (None: all in one); ``ray``: a
    :class:`uhead_vllm.scaleout.RayOptions` to answer the batches on Ray actors (same answers and
    steps as here with the same ``batch_size``, default 64 then; the head's probabilities agree to
    float rounding, as its arithmetic may run on another number of threads there)."""
    from ..heads import load_head_for_model
    from ..models import resolve_model
    from ..runtime import set_threads

    check_questions(questions)
    set_threads(threads)
    path = resolve_model(model)
    if ray is not None or batch_size is not None:
        job = AnswerJob(str(path), None if head_dir is None else str(head_dir), list(questions), batch_size or 64,
                        max_tokens, dict(engine or {}), allow_other_weights)
        scored = answer_in_units(job, ray=ray, generator=generator)
    else:
        head = load_head_for_model(head_dir, path, allow_other_weights=allow_other_weights)
        assert head.recipe is not None  # a head without a feature recipe cannot be applied (would fail below)
        gen = generator if generator is not None else build_job_generator(path, head.recipe.layers, **(engine or {}))
        scored = answer_questions(list(questions), gen, head, max_tokens)
    file = file or sys.stdout
    if as_json:
        print(json.dumps([s.to_dict() for s in scored], indent=2), file=file)
    else:
        print(format_table(scored), file=file)
    return scored
