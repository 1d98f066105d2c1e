"""The main job: questions in, answers out, each with per-step and per-answer uncertainty from a head.

:func:`answer` is ``uhead-vllm answer`` (and ``uhead_vllm.answer``): it builds the engine for the
head's layers, prompts and splits like the head's training data (its :class:`~uhead_vllm.heads.HeadUsage`),
and scores each answer and step. The server (:mod:`uhead_vllm.serving.scoring`) scores with
:func:`score_generation` too, so served and offline numbers agree.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .. import tasks
from ..features import StepSpan, split_steps
from ..heads import UncertaintyHead
from .recipe import GenerationRecipe
from .spans import AnswerArrays, SpanBatch, answer_scores, logprob_arrays, span_features


def build_job_generator(model_path: str | Path, layers: Sequence[int], **engine_overrides: Any) -> Any:
    """The engine of the main job and of the study's collection (so a head scores answers captured
    like its training data): :data:`~uhead_vllm.generation.SMALL_CPU_ENGINE` (``engine_overrides``
    replace entries), bf16 rows, a 256 MiB prefix row store, one-step generation (a candidate idle
    for one call is dropped), vLLM logging errors only."""
    from ..generation import SMALL_CPU_ENGINE, build_generator
    from ..runtime import set_env_defaults

    set_env_defaults(quiet=True)
    return build_generator(model_path, layers, capture_dtype="bfloat16",
                           generator_kwargs={"store_max_bytes": 256 << 20, "step_cache_max_idle": 1},
                           **{**SMALL_CPU_ENGINE, **engine_overrides})


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
    return ScoredAnswer(question, output.text, tasks.extract_answer(output.text), p_answer, scored,
                        output.finish_reason)


def check_questions(questions: Sequence[str]) -> None:
    """Fail before any engine is built: at least one question, none empty."""
    if not questions or any(not q.strip() for q in questions):
        raise ValueError("give at least one non-empty question")


def answer_questions(questions: Sequence[str], generator: Any, head: UncertaintyHead,
                     max_tokens: int | None = None) -> list[ScoredAnswer]:
    """Generate answers with the head's own prompt recipe and score them."""
    check_questions(questions)
    settings = dict(head.require_usage(generation=True).generation)
    if max_tokens is not None:
        settings["max_tokens"] = int(max_tokens)
    recipe = GenerationRecipe(**settings)
    missing = [k for k in head.recipe.layers if k not in generator.layers]
    if missing:
        raise ValueError(f"the engine captures layers {list(generator.layers)}; the head needs {missing}")
    res = generator.generate([recipe.chat(q) for q in questions], recipe.sampling_params())
    return [score_generation(head, ro.outputs[0], samples[0], generator.tokenizer, recipe, q)
            for q, ro, samples in zip(questions, res.outputs, res.hidden_states)]


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
    from .units import AnswerJob, answer_in_units

    check_questions(questions)
    set_threads(threads)
    path = resolve_model(model)
    if ray is not None or batch_size is not None:
        job = AnswerJob(str(path), None if head_dir is None else str(head_dir), list(questions), batch_size or 64,
                        max_tokens, dict(engine or {}), allow_other_weights)
        scored = answer_in_units(job, ray=ray, generator=generator)
    else:
        head = load_head_for_model(head_dir, path, allow_other_weights=allow_other_weights)
        gen = generator if generator is not None else build_job_generator(path, head.recipe.layers, **(engine or {}))
        scored = answer_questions(list(questions), gen, head, max_tokens)
    file = file or sys.stdout
    if as_json:
        print(json.dumps([s.to_dict() for s in scored], indent=2), file=file)
    else:
        print(format_table(scored), file=file)
    return scored
