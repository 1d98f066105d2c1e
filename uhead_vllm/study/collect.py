"""Collect labelled answers from a real model: generate with capture, grade, split and label steps,
compute logprob baselines, and write a :mod:`uhead_vllm.study.data` dataset directory."""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Sequence

import torch
from tqdm.auto import tqdm

from .. import tasks
from ..features import split_steps
from ..models import model_identity
from ..scaleout import RayOptions, run_units
from ..scoring.recipe import GenerationRecipe
from ..scoring.spans import AnswerArrays, logprob_arrays
from .baselines import span_baselines
from .data import AnswerRecord, StepRecordJson
from .partial import PartialDataset


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


def select_questions(plan: TaskPlan, exclude: AbstractSet[str] = frozenset(), unique: bool = True,
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


@dataclass
class CollectJob:
    """One collection, as JSON: what any replica needs to produce any unit, and what a resumed run
    must match. Unit ``k`` is questions ``k*batch_size`` up to the next multiple: one vLLM call,
    one shard. Units are the same whoever runs them, so the dataset is too."""

    out: str
    model: str
    layers: list[int]
    recipe: dict[str, Any]
    questions: list[dict[str, Any]]
    batch_size: int = 64
    engine: dict[str, Any] = field(default_factory=dict)
    capture_dtype: str = "bfloat16"
    about: dict[str, Any] = field(default_factory=dict)  # for the manifest: the plans, what was excluded

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not self.questions:
            raise ValueError("no questions selected")

    @property
    def n_units(self) -> int:
        return -(-len(self.questions) // self.batch_size)

    def unit_questions(self, unit: int) -> list[tasks.Question]:
        return [tasks.Question(**q) for q in self.questions[unit * self.batch_size : (unit + 1) * self.batch_size]]

    def unit_size(self, unit: int) -> int:
        return min(self.batch_size, len(self.questions) - unit * self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_job(out: str | Path, task_plans: Sequence[str], model: str | Path, layers: Sequence[int],
             recipe: GenerationRecipe, *, exclude: AbstractSet[str] = frozenset(), batch_size: int = 64,
             engine: dict[str, Any] | None = None, about: dict[str, Any] | None = None) -> CollectJob:
    """The job for ``task_plans`` (``task:n:seed`` each, or ``file:PATH`` for a JSON-lines question
    file, see :func:`uhead_vllm.tasks.load_question_file`; questions in ``exclude`` skipped, none
    twice); the manifest will say what was selected per plan, plus ``about``."""
    questions: list[tasks.Question] = []
    selected = []
    for spec in task_plans:
        taken = set(exclude) | {q.question for q in questions}
        if spec.startswith(f"{tasks.FILE_TASK}:"):
            path = spec.split(":", 1)[1]
            qs = [q for q in tasks.load_question_file(path) if q.question not in taken]
            selected.append({"task": tasks.FILE_TASK, "path": Path(path).name, "selected": len(qs)})
        else:
            plan = TaskPlan.parse(spec)
            qs = select_questions(plan, taken)
            selected.append({**asdict(plan), "selected": len(qs)})
        questions.extend(qs)
    return CollectJob(str(out), str(model), [int(k) for k in layers], recipe.to_dict(), [asdict(q) for q in questions],
                      batch_size, dict(engine or {}),
                      about={"tasks": selected, "excluded_questions": len(exclude), **(about or {})})


class CollectWorker:
    """A replica's side of a collection: one capturing engine; unit ``k`` in, the unit's shard and
    answers written into the dataset's ``.partial`` folder, a small summary out."""

    def __init__(self, job: dict[str, Any], generator: Any = None):
        self.job = CollectJob(**job)
        self.recipe = GenerationRecipe(**self.job.recipe)
        if generator is None:
            from ..scoring.recipe import build_job_generator

            generator = build_job_generator(self.job.model, self.job.layers, **self.job.engine)
        dtype = generator.client.settings.dtype
        if list(generator.layers) != list(self.job.layers) or dtype != self.job.capture_dtype:
            raise ValueError(f"the generator captures layers {list(generator.layers)} as {dtype}; the job asks "
                             f"for {self.job.layers} as {self.job.capture_dtype}")
        self.generator = generator
        self.partial = PartialDataset(self.job.out, self.job.to_dict())

    def run(self, unit: int) -> dict[str, Any]:
        questions = self.job.unit_questions(unit)
        gen = self.generator
        # From a cold prefix cache: a unit's numbers must not depend on which units its replica ran before.
        gen.reset_hs_step_cache(reset_prefix_cache=True)
        t0 = time.perf_counter()
        # Heads train on generated rows only (FeatureRecipe.window): the prompts' rows are not captured.
        res = gen.generate([self.recipe.chat(q) for q in questions], self.recipe.sampling_params(), window="generated")
        answers = [build_answer(q, output, sample, gen.tokenizer, self.recipe)
                   for q, ro, samples in zip(questions, res.outputs, res.hidden_states)
                   for output, sample in zip(ro.outputs, samples)]  # recipe.samples answers per question
        self.partial.write_unit(unit, answers)
        return {"unit": unit, "questions": len(questions), "answers": len(answers),
                "correct": sum(r.correct for r, _ in answers), "rows": sum(r.n_rows for r, _ in answers),
                "seconds": time.perf_counter() - t0, "replica": os.getpid()}


def collect(job: CollectJob, *, generator: Any = None, ray: RayOptions | None = None, overwrite: bool = False,
            progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """Write dataset ``job.out``: in this process with ``generator`` (or one built from the job), or
    on Ray actors (``ray``). Finished units of an interrupted run of the same job are kept (resume).
    Returns the dataset path and what the run did (units done here / resumed, rows/s, Ray stats)."""
    partial = PartialDataset(job.out, job.to_dict())
    resumed = partial.open(overwrite=overwrite)
    finished = set(resumed)
    todo = [u for u in range(job.n_units) if u not in finished]
    already = sum(job.unit_size(u) for u in resumed)
    bar = tqdm(total=len(job.questions), initial=already, desc=f"collect {Path(job.out).name}", unit="question",
               disable=not progress)
    tally = {"answers": 0, "correct": 0, "rows": 0}
    busy: dict[int, float] = {}  # seconds inside units, per replica process

    def done(unit: int, summary: dict[str, Any]) -> None:
        for key in tally:
            tally[key] += summary[key]
        busy[summary["replica"]] = busy.get(summary["replica"], 0.0) + summary["seconds"]
        bar.update(summary["questions"])
        bar.set_postfix(acc=f"{tally['correct'] / max(tally['answers'], 1):.2f}")

    t0 = time.perf_counter()
    run: dict[str, Any] = {"units": job.n_units, "resumed_units": resumed, "executor": "ray" if ray else "local"}
    try:
        if ray is not None:
            stats = run_units(CollectWorker, job.to_dict(), todo, ray, on_done=done)
            run.update(replicas=ray.replicas, actors_started=stats.actors_started,
                       actors_replaced=stats.actors_replaced, units_retried=stats.units_retried)
        elif todo:
            worker = CollectWorker(job.to_dict(), generator)
            for unit in todo:
                done(unit, worker.run(unit))
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    # Steady state: rows over the busiest replica's time inside units (engine start excluded).
    steady = max(busy.values(), default=0.0)
    run.update(seconds=seconds, rows=tally["rows"], rows_per_s=tally["rows"] / seconds if seconds else 0.0,
               replicas_used=len(busy), busiest_replica_s=steady,
               rows_per_s_steady=tally["rows"] / steady if steady else 0.0)
    identity = model_identity(job.model)
    manifest = {
        "model_identity": identity,
        "layers": list(job.layers),
        "capture_dtype": job.capture_dtype,
        "hidden_size": identity["hidden_size"],
        "recipe": job.recipe,
        "units": {"count": job.n_units, "questions_per_unit": job.batch_size, "questions": len(job.questions)},
        **job.about,
    }
    return partial.finish(job.n_units, manifest), run
