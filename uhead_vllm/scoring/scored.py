"""Answers scored by a head: per-step and per-answer P(wrong) of the answers of one engine call.

:func:`answer_questions` prompts like the head's training data (its
:class:`~uhead_vllm.heads.HeadUsage`) and scores each answer with :func:`score_generation`; the
server (:mod:`uhead_vllm.serving.scoring`) scores with :func:`score_generation` too, so served and
offline numbers agree. The main job (:mod:`.answer`) and its units (:mod:`.units`) build on these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ..features import StepSpan, split_steps
from ..heads import UncertaintyHead
from .arithmetic import extract_answer
from .recipe import GenerationRecipe
from .spans import AnswerArrays, SpanBatch, answer_scores, logprob_arrays, span_features


@dataclass
class ScoredStep:
    """One step of an answer; ``uncertainty`` = the head's P(step is wrong), None if the step has
    no hidden row (a step made only of the final sampled token)."""

    text: str
    start: int
    end: int
    uncertainty: float | None


@dataclass
class ScoredAnswer:
    question: str
    text: str
    extracted: str | None
    uncertainty: float  # P(answer is wrong)
    steps: list[ScoredStep] = field(default_factory=list)
    finish_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def score_generation(head: UncertaintyHead, output: Any, sample: Any, tokenizer: Any, recipe: GenerationRecipe,
                     question: str) -> ScoredAnswer:
    """Score one vLLM output (with logprobs) and its captured rows."""
    assert head.recipe is not None  # a head without a feature recipe cannot be applied (would fail below)
    ids = list(output.token_ids)
    token_lp, topk = logprob_arrays(output, recipe.logprobs)
    arrays = AnswerArrays(sample.generated_rows(), torch.tensor(ids, dtype=torch.int64), token_lp, topk)
    layers = list(sample.layers)
    spans = split_steps(ids, tokenizer, mode=recipe.split_mode) if ids else []
    steps = SpanBatch()
    scored = []
    for s in spans:
        feats = span_features(arrays, s, head.recipe, layers)
        scored.append(ScoredStep(tokenizer.decode(ids[s.start : s.end], skip_special_tokens=True), s.start, s.end, None))
        if feats is not None:
            steps.features.append(feats)
            steps.answer_ids.append("a")
            scored[-1].uncertainty = -1.0  # placeholder, filled below
    step_probs = head.predict_proba(steps.features) if steps.features else np.empty(0)
    probs = iter(step_probs)
    for st in scored:
        if st.uncertainty is not None:
            st.uncertainty = float(next(probs))
    whole = span_features(arrays, StepSpan(0, len(ids)), head.recipe, layers) if ids else None
    if whole is None:
        raise ValueError(f"the answer to {question!r} has no hidden rows to score ({len(ids)} token(s))")
    rule = head.require_usage().answer_scoring
    p_answer = float(answer_scores(head, SpanBatch([whole], ["a"]), steps, rule, step_probs)[0])
    return ScoredAnswer(question, output.text, extract_answer(output.text), p_answer, scored,
                        output.finish_reason)


def check_questions(questions: Sequence[str]) -> None:
    """Fail before any engine is built: at least one question, none empty."""
    if not questions or any(not q.strip() for q in questions):
        raise ValueError("give at least one non-empty question")


def answer_questions(questions: Sequence[str], generator: Any, head: UncertaintyHead,
                     max_tokens: int | None = None) -> list[ScoredAnswer]:
    """Generate answers with the head's own prompt recipe and score them."""
    check_questions(questions)
    generation = head.require_usage(generation=True).generation
    assert generation is not None  # require_usage(generation=True) refuses a head without one
    settings = dict(generation)
    if max_tokens is not None:
        settings["max_tokens"] = int(max_tokens)
    recipe = GenerationRecipe(**settings)
    assert head.recipe is not None  # a head without a feature recipe cannot be applied (would fail below)
    missing = [k for k in head.recipe.layers if k not in generator.layers]
    if missing:
        raise ValueError(f"the engine captures layers {list(generator.layers)}; the head needs {missing}")
    res = generator.generate([recipe.chat(q) for q in questions], recipe.sampling_params(), window=head.recipe.window)
    return [score_generation(head, ro.outputs[0], samples[0], generator.tokenizer, recipe, q)
            for q, ro, samples in zip(questions, res.outputs, res.hidden_states)]
