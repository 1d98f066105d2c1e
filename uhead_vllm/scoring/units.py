"""The main job over many questions, in units of ``batch_size`` questions (one vLLM call each),
in this process or on Ray actors (:mod:`uhead_vllm.scaleout`). Units are the same wherever they
run, so the answers are too (the head's probabilities to float rounding: its arithmetic may run on
another number of threads); each unit's scored answers come back as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..scaleout import RayOptions, run_units
from .recipe import build_job_generator
from .scored import ScoredAnswer, ScoredStep, answer_questions


@dataclass
class AnswerJob:
    """What any replica needs to answer any unit: model, head, questions (JSON)."""

    model: str
    head_dir: str | None
    questions: list[str]
    batch_size: int = 64
    max_tokens: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    allow_other_weights: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")

    @property
    def n_units(self) -> int:
        return -(-len(self.questions) // self.batch_size)

    def unit_questions(self, unit: int) -> list[str]:
        return self.questions[unit * self.batch_size : (unit + 1) * self.batch_size]


class AnswerWorker:
    """A replica's side of the main job: the head and one capturing engine for its layers."""

    def __init__(self, job: dict[str, Any], generator: Any = None):
        from ..heads import load_head_for_model

        self.job = AnswerJob(**job)
        self.head = load_head_for_model(self.job.head_dir, Path(self.job.model),
                                        allow_other_weights=self.job.allow_other_weights)
        assert self.head.recipe is not None  # a head without a feature recipe cannot be applied (would fail below)
        self.generator = generator if generator is not None else build_job_generator(
            self.job.model, self.head.recipe.layers, **self.job.engine)

    def run(self, unit: int) -> dict[str, Any]:
        # From a cold prefix cache: a unit's numbers must not depend on what its replica ran before.
        self.generator.reset_hs_step_cache(reset_prefix_cache=True)
        scored = answer_questions(self.job.unit_questions(unit), self.generator, self.head, self.job.max_tokens)
        return {"unit": unit, "answers": [s.to_dict() for s in scored]}


def _from_dict(d: dict[str, Any]) -> ScoredAnswer:
    return ScoredAnswer(**{**d, "steps": [ScoredStep(**s) for s in d["steps"]]})


def answer_in_units(job: AnswerJob, *, ray: RayOptions | None = None, generator: Any = None) -> list[ScoredAnswer]:
    """Scored answers of ``job.questions`` in their order, unit by unit here (``generator``, or one
    built for the head) or on Ray actors (``ray``)."""
    results: dict[int, list[dict[str, Any]]] = {}
    units: Sequence[int] = range(job.n_units)
    if ray is not None:
        run_units(AnswerWorker, asdict(job), units, ray,
                  on_done=lambda unit, summary: results.__setitem__(unit, summary["answers"]))
    else:
        worker = AnswerWorker(asdict(job), generator)
        for unit in units:
            results[unit] = worker.run(unit)["answers"]
    return [_from_dict(d) for unit in units for d in results[unit]]
