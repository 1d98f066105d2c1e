"""Turn stored answers into head inputs: per-token feature matrices with labels and baselines.

Two levels share one code path:
- ``step``: every step whose label is known (``tasks.label_steps`` gave 0/1; None is excluded);
- ``answer``: the whole generated answer as one span, labelled by the final grade.
Spans are clipped to the rows that exist (the last sampled token, usually EOS, has none); the
logprob baselines use the full span, since they have a logprob for every token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..features import FeatureRecipe, StepSpan
from ..scoring.spans import AnswerArrays, span_features
from .baselines import BASELINES, span_baselines
from .data import AnswerRecord, DatasetError, StudyDataset

Level = Literal["step", "answer"]
LEVELS: tuple[Level, ...] = ("step", "answer")


@dataclass
class Examples:
    """Aligned lists: ``features[j]`` (``[t, F]`` float32), ``labels[j]`` (1 = wrong, 0 = right,
    -1 = unlabelled), the answer it came from, its task, and baseline uncertainties per name."""

    level: str
    features: list[torch.Tensor] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    answer_ids: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    baselines: dict[str, list[float]] = field(default_factory=lambda: {b: [] for b in BASELINES})

    def __len__(self) -> int:
        return len(self.labels)

    def y(self) -> np.ndarray:
        return np.asarray(self.labels, dtype=np.int64)

    def labelled(self) -> np.ndarray:
        """Indices of examples with a 0/1 label."""
        return np.flatnonzero(self.y() >= 0)

    def subset(self, idx: Sequence[int]) -> "Examples":
        sub = Examples(self.level, [self.features[i] for i in idx], [self.labels[i] for i in idx],
                       [self.answer_ids[i] for i in idx], [self.tasks[i] for i in idx])
        sub.baselines = {b: [v[i] for i in idx] for b, v in self.baselines.items()}
        return sub

    def baseline(self, name: str) -> np.ndarray:
        return np.asarray(self.baselines[name], dtype=np.float64)

    def extend(self, other: "Examples") -> None:
        self.features += other.features
        self.labels += other.labels
        self.answer_ids += other.answer_ids
        self.tasks += other.tasks
        for b in BASELINES:
            self.baselines[b] += other.baselines[b]


def check_recipe(ds: StudyDataset, recipe: FeatureRecipe) -> None:
    missing = [k for k in recipe.layers if k not in ds.layers]
    if missing:
        raise DatasetError(f"{ds.path}: recipe layers {missing} were not captured (dataset has {ds.layers})")
    k = int(ds.manifest["recipe"]["logprobs"])
    if recipe.logprob_topk > k:
        raise DatasetError(f"{ds.path}: recipe wants top-{recipe.logprob_topk} logprobs, dataset stored top-{k}")


def spans_of(record: AnswerRecord, level: Level, labelled_only: bool = True) -> list[tuple[StepSpan, int | None]]:
    """Spans and labels of one answer at ``level``."""
    if level == "answer":
        return [(StepSpan(0, record.n_tokens), record.wrong)]
    if level == "step":
        return [(StepSpan(s.start, s.end), s.label) for s in record.steps if s.label is not None or not labelled_only]
    raise ValueError(f"unknown level {level!r}; expected one of {LEVELS}")


def answer_examples(record: AnswerRecord, arrays: AnswerArrays, recipe: FeatureRecipe,
                    layers: Sequence[int], level: Level, answer_id: str | None = None,
                    labelled_only: bool = True) -> Examples:
    """Examples of one answer; with ``labelled_only=False`` unlabelled steps come with label -1."""
    ex = Examples(level)
    for span, label in spans_of(record, level, labelled_only):
        feats = span_features(arrays, span, recipe, layers)
        if feats is None:
            continue
        ex.features.append(feats)
        ex.labels.append(-1 if label is None else int(label))
        ex.answer_ids.append(answer_id or record.qid)
        ex.tasks.append(record.task)
        for name, value in span_baselines(arrays.token_logprobs, arrays.topk_logprobs, span.start, span.end).items():
            ex.baselines[name].append(value)
    return ex


def load_examples(datasets: Iterable[StudyDataset], recipe: FeatureRecipe, levels: Sequence[Level] = LEVELS,
                  progress: bool = True, labelled_only: bool = True) -> dict[str, Examples]:
    """Examples at each level from all ``datasets`` (read once)."""
    out: dict[str, Examples] = {lv: Examples(lv) for lv in levels}
    datasets = list(datasets)
    total = sum(len(ds) for ds in datasets)
    with tqdm(total=total, desc="features", unit="answer", disable=not progress, leave=False) as bar:
        for ds in datasets:
            check_recipe(ds, recipe)
            for record, arrays in ds.iter_arrays():
                for lv in levels:
                    out[lv].extend(answer_examples(record, arrays, recipe, ds.layers, lv,
                                                   f"{ds.name}:{record.index}", labelled_only))
                bar.update(1)
    return out
