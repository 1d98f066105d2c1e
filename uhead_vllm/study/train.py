"""Train a head on one or more study datasets and save it with its data recipe.

``level`` says what the head learns from:
- ``step``: labelled steps only; an answer is then scored by its most doubtful step (``max_step``);
- ``answer``: whole answers labelled by the final grade; answers are scored on their full span;
- ``joint``: both kinds of examples in one head, so one small file scores steps *and* answers
  (an answer is a span like a step, just longer).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..features import FeatureRecipe
from ..heads import AttentionPoolingHead, LinearProbeHead, UncertaintyHead
from .collect import GenerationRecipe
from .data import DatasetError, StudyDataset
from .examples import Examples, load_examples

HEAD_CLASSES: dict[str, type[UncertaintyHead]] = {"linear": LinearProbeHead, "attention": AttentionPoolingHead}
TRAIN_LEVELS = ("step", "answer", "joint")


def default_answer_scoring(level: str) -> str:
    return "max_step" if level == "step" else "span"


def open_datasets(paths: Sequence[str | Path]) -> list[StudyDataset]:
    """Open datasets and check they come from one model with the same captured layers."""
    if not paths:
        raise DatasetError("no dataset directories given")
    sets = [StudyDataset(p) for p in paths]
    first = sets[0]
    for ds in sets[1:]:
        if ds.model_identity != first.model_identity:
            raise DatasetError(f"{ds.path} comes from model {ds.model_identity}, {first.path} from {first.model_identity}")
        if ds.layers != first.layers:
            raise DatasetError(f"{ds.path} captured layers {ds.layers}, {first.path} captured {first.layers}")
        differ = [k for k in GenerationRecipe.FEATURE_FIELDS if ds.manifest["recipe"][k] != first.manifest["recipe"][k]]
        if differ:
            raise DatasetError(f"{ds.path} and {first.path} were generated with different {', '.join(differ)}")
    return sets


def training_examples(examples: dict[str, Examples], level: str) -> Examples:
    if level not in TRAIN_LEVELS:
        raise ValueError(f"unknown level {level!r}; expected one of {TRAIN_LEVELS}")
    if level != "joint":
        return examples[level]
    both = Examples("joint")
    both.extend(examples["step"])
    both.extend(examples["answer"])
    return both


def make_head(head_type: str, recipe: FeatureRecipe, identity: dict[str, Any], seed: int,
              progress: bool, **hyper: Any) -> UncertaintyHead:
    if head_type not in HEAD_CLASSES:
        raise ValueError(f"unknown head type {head_type!r}; expected one of {sorted(HEAD_CLASSES)}")
    if head_type == "attention":
        hyper = {"seed": seed, "progress": progress, **hyper}
    return HEAD_CLASSES[head_type](recipe=recipe, model_identity=identity, **hyper)


def train_head(dataset_dirs: Sequence[str | Path], head_type: str = "attention", level: str = "joint",
               layers: Sequence[int] | None = None, pooling: str = "mean", logprob_topk: int = 0,
               seed: int = 0, hyper: dict[str, Any] | None = None, progress: bool = True,
               examples: dict[str, Examples] | None = None) -> UncertaintyHead:
    """Fit a head on the datasets (or on preloaded ``examples`` from them)."""
    sets = open_datasets(dataset_dirs)
    recipe = FeatureRecipe(list(layers) if layers else sets[0].layers, pooling, logprob_topk)
    if examples is None:
        examples = load_examples(sets, recipe, progress=progress)
    train = training_examples(examples, level)
    y = train.y()
    if len(y) == 0 or y.min() == y.max():
        raise ValueError(f"{level}-level training data needs right and wrong examples; got {np.bincount(y, minlength=2).tolist()}")
    head = make_head(head_type, recipe, sets[0].model_identity, seed, progress, **(hyper or {}))
    t0 = time.perf_counter()
    head.fit(train.features, y)
    summary = dict(getattr(head, "training_summary_", {}))
    summary["study"] = {
        "level": level,
        "answer_scoring": default_answer_scoring(level),
        "generation": sets[0].manifest["recipe"],
        "datasets": [{"name": ds.name, "tasks": ds.manifest["tasks"], "counts": ds.manifest["counts"]["total"]}
                     for ds in sets],
        "n_examples": len(y),
        "n_wrong": int(y.sum()),
        "fit_seconds": round(time.perf_counter() - t0, 1),
    }
    head.training_summary_ = summary
    return head


def study_settings(head: UncertaintyHead) -> dict[str, Any]:
    """The data recipe a head was trained with (prompt style, splitting, answer scoring)."""
    study = getattr(head, "training_summary_", {}).get("study")
    if not study:
        raise ValueError("this head has no study recipe (was it trained with `uhead-vllm train`?)")
    return study
