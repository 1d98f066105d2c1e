"""Train a head on one or more study datasets and save it with its data recipe.

``level`` says what the head learns from:
- ``step``: labelled steps only; an answer is then scored by its most doubtful step (``max_step``);
- ``answer``: whole answers labelled by the final grade; answers are scored on their full span;
- ``joint``: both kinds of examples in one head, so one small file scores steps *and* answers
  (an answer is a span like a step, just longer).
The level, the answer scoring rule and the datasets' generation recipe are saved as the head's
usage (:class:`uhead_vllm.heads.HeadUsage`); ``training["study"]`` keeps what it was trained on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..features import FeatureRecipe, Pooling
from ..heads import HeadUsage, UncertaintyHead, head_class
from ..heads.base import HEAD_LEVELS
from ..scoring.recipe import GenerationRecipe
from .data import DatasetError, StudyDataset
from .examples import Examples, load_examples


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
    if level not in HEAD_LEVELS:
        raise ValueError(f"unknown level {level!r}; expected one of {HEAD_LEVELS}")
    if level != "joint":
        return examples[level]
    both = Examples("joint")
    both.extend(examples["step"])
    both.extend(examples["answer"])
    return both


def make_head(head_type: str, recipe: FeatureRecipe, identity: dict[str, Any], seed: int,
              progress: bool, **hyper: Any) -> UncertaintyHead:
    """A head of registered type ``head_type`` (:func:`uhead_vllm.heads.head_class`); ``seed`` and
    ``progress`` go to heads that take them."""
    cls = head_class(head_type)
    common = {k: v for k, v in (("seed", seed), ("progress", progress)) if k in cls._param_names}
    return cls(recipe=recipe, model_identity=identity, **{**common, **hyper})


def train_head(dataset_dirs: Sequence[str | Path], head_type: str = "attention", level: str = "joint",
               layers: Sequence[int] | None = None, pooling: Pooling = "mean", logprob_topk: int = 0,
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
        "datasets": [{"name": ds.name, "tasks": ds.manifest["tasks"], "counts": ds.manifest["counts"]["total"]}
                     for ds in sets],
        "n_examples": len(y),
        "n_wrong": int(y.sum()),
        "fit_seconds": round(time.perf_counter() - t0, 1),
    }
    head.training_summary_ = summary
    head.usage = HeadUsage.for_level(level, sets[0].manifest["recipe"])
    return head
