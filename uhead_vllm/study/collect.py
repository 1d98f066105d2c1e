"""Collect labelled answers from a real model: generate with capture, grade, split and label steps,
compute logprob baselines, and write a :mod:`uhead_vllm.study.data` dataset directory."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from .. import tasks
from ..adapters import engine as engine_internals
from ..features import split_steps
from ..scoring.recipe import GenerationRecipe
from ..scoring.spans import AnswerArrays, logprob_arrays
from .baselines import span_baselines
from .data import AnswerRecord, DatasetWriter, StepRecordJson


@dataclass
class TaskPlan:
    """``n`` questions of ``task`` drawn with ``seed``."""

    task: str
    n: int
    seed: int

    @classmethod
    def parse(cls, spec: str) -> "TaskPlan":
        """``"task:n:seed"`` (e.g. ``basic_arithmetic:800:0``)."""
        parts = spec.split(":")
        if len(parts) != 3:
            raise ValueError(f"task plan {spec!r} must look like task:n:seed")
        return cls(parts[0], int(parts[1]), int(parts[2]))


def select_questions(plan: TaskPlan, exclude: set[str] = frozenset(), unique: bool = True,
                     max_pool_factor: int = 64) -> list[tasks.Question]:
    """``plan.n`` questions whose text is not in ``exclude`` (and distinct if ``unique``).

    Small configurations (1-digit chain sums: ~200 distinct questions) repeat questions; repeats
    across a train and a test split would leak, so the pool grows until enough distinct ones are
    found, or stops at what exists.
    """
    pool = max(plan.n, 1)
    while True:
        chosen, seen = [], set(exclude)
        for q in tasks.load_questions(plan.task, pool, plan.seed):
            if q.question in seen:
                continue
            if unique:
                seen.add(q.question)
            chosen.append(q)
            if len(chosen) == plan.n:
                return chosen
        if pool >= plan.n * max_pool_factor:
            return chosen
        pool *= 2


_ANSWER_STATEMENT = re.compile(r"\banswer\b", re.IGNORECASE)


def label_study_steps(question: tasks.Question, step_texts: list[str], correct: bool) -> list[int | None]:
    """``tasks.label_steps`` plus one rule: a step that *states* an answer in words ("The answer is
    89.", "The final answer ... is 152.") is checked against the reference like a final answer.

    SmolLM2 mostly ends with such sentences instead of the requested "Answer: <n>" line; without
    this rule every one of them would be unlabelled.
    """
    labels = tasks.label_steps(step_texts, correct)
    for i, (text, label) in enumerate(zip(step_texts, labels)):
        if label is None and _ANSWER_STATEMENT.search(text) and tasks.extract_answer(text) is not None:
            labels[i] = int(not tasks.grade(question, text)[0])
    return labels


def build_answer(question: tasks.Question, output: Any, sample: Any, tokenizer: Any,
                 recipe: GenerationRecipe) -> tuple[AnswerRecord, AnswerArrays]:
    """Grade one generated answer, split and label its steps, compute baselines; keep only the
    rows of generated tokens."""
    ids = list(output.token_ids)
    if not ids:
        raise ValueError(f"{question.qid}: empty generation")
    token_lp, topk = logprob_arrays(output, recipe.logprobs)
    correct, score = tasks.grade(question, output.text)
    spans = split_steps(ids, tokenizer, mode=recipe.split_mode)
    texts = [tokenizer.decode(ids[s.start : s.end], skip_special_tokens=True) for s in spans]
    labels = label_study_steps(question, texts, correct)
    hidden = sample.generated_rows().clone()
    record = AnswerRecord(
        index=-1, qid=question.qid, task=question.task, question=question.question,
        reference=question.answer, text=output.text, extracted=tasks.extract_answer(output.text),
        correct=bool(correct), score=float(score), finish_reason=output.finish_reason,
        n_tokens=len(ids), n_rows=int(hidden.shape[0]), prompt_tokens=sample.prompt_len, shard="",
        steps=[StepRecordJson(s.start, s.end, t, lab) for s, t, lab in zip(spans, texts, labels)],
        baselines=span_baselines(token_lp, topk),
    )
    return record, AnswerArrays(hidden, torch.tensor(ids, dtype=torch.int64), token_lp, topk)


def collect(generator: Any, out_dir: str | Path, plans: Sequence[TaskPlan], recipe: GenerationRecipe,
            *, model_identity: dict[str, Any], exclude_questions: Iterable[str] = (),
            batch_size: int = 64, shard_size: int = 256, overwrite: bool = False,
            progress: bool = True, extra_manifest: dict[str, Any] | None = None) -> Path:
    """Generate answers for ``plans`` with ``generator`` and write a dataset to ``out_dir``."""
    exclude = set(exclude_questions)
    questions: list[tasks.Question] = []
    selected = []
    for plan in plans:
        qs = select_questions(plan, exclude | {q.question for q in questions})
        selected.append({**asdict(plan), "selected": len(qs)})
        questions.extend(qs)
    if not questions:
        raise ValueError("no questions selected")
    writer = DatasetWriter(out_dir, shard_size=shard_size, overwrite=overwrite)
    params = recipe.sampling_params()
    bar = tqdm(total=len(questions), desc=f"collect {Path(out_dir).name}", unit="question", disable=not progress)
    for b in range(0, len(questions), batch_size):
        batch = questions[b : b + batch_size]
        res = generator.generate([recipe.chat(q) for q in batch], params)
        for q, ro, samples in zip(batch, res.outputs, res.hidden_states):
            for output, sample in zip(ro.outputs, samples):  # recipe.samples answers per question
                record, arrays = build_answer(q, output, sample, generator.tokenizer, recipe)
                writer.add(record, arrays)
        generator.step_cache.clear()  # single-step study: no trajectories to keep
        bar.update(len(batch))
        done = writer.records
        bar.set_postfix(acc=f"{sum(r.correct for r in done) / len(done):.2f}")
    bar.close()
    manifest = {
        "model_identity": model_identity,
        "layers": list(generator.layers),
        "capture_dtype": str(generator.client.settings.dtype),
        "hidden_size": engine_internals.hidden_size(generator.llm),
        "recipe": recipe.to_dict(),
        "tasks": selected,
        "excluded_questions": len(exclude),
        **(extra_manifest or {}),
    }
    return writer.close(manifest)
