"""lm-polygraph estimators that apply a saved uncertainty head (and a length baseline).

Uncertainty is the head's P(wrong): higher = more uncertain, as lm-polygraph expects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
from lm_polygraph.estimators.estimator import Estimator

from ..features import FeatureRecipe
from ..heads import HeadMismatchError
from .head_io import check_head_for_model, load_checked_head

REDUCTIONS = ("whole", "max", "mean", "last")


class _HeadEstimator(Estimator):
    """Loads the head at construction (so a bad path fails before any generation) and checks it
    against the served model and the features' recipe on the first batch."""

    def __init__(self, head_path: str | Path, stats: list[str], level: str, name: str,
                 allow_other_weights: bool = False):
        self.head, self.head_dir = load_checked_head(head_path)
        self.allow_other_weights = allow_other_weights
        if self.head.recipe is None:
            raise HeadMismatchError(f"head {self.head_dir} has no feature recipe; save heads with recipe=FeatureRecipe(...)")
        self.name = name
        self._checked = False
        super().__init__(stats + ["uhead_feature_recipe", "uhead_model_identity"], level)

    def __str__(self) -> str:
        return self.name

    def _check(self, stats: dict[str, Any]) -> None:
        if self._checked:
            return
        check_head_for_model(self.head.config(), stats["uhead_model_identity"], str(self.head_dir),
                             self.allow_other_weights)
        got = FeatureRecipe.from_dict(stats["uhead_feature_recipe"])
        if got != self.head.recipe:
            raise HeadMismatchError(
                f"head {self.head_dir} was trained with features {self.head.recipe} but the features "
                f"calculator builds {got}; give estimators.uhead_features the same head_path"
            )
        self._checked = True

    def _proba(self, feats: list[Any]) -> np.ndarray:
        """P(wrong) per feature matrix; NaN where a matrix is missing (rows not computed)."""
        out = np.full(len(feats), np.nan)
        have = [i for i, f in enumerate(feats) if f is not None]
        if have:
            out[have] = self.head.predict_proba([feats[i] for i in have])
        return out


class UHeadSequence(_HeadEstimator):
    """Sequence-level P(wrong) of the answer.

    ``reduce``: ``whole`` applies the head to the whole answer's token matrix (a head trained on
    answers); ``max`` / ``mean`` / ``last`` reduce per-claim probabilities (a head trained on steps);
    ``auto`` follows the head's usage (:class:`uhead_vllm.heads.HeadUsage`, saved with the head):
    ``max`` for a head that scores answers by their worst step (``answer_scoring: max_step``, a head
    trained on steps, e.g. the default head), else ``whole``.
    """

    def __init__(self, head_path: str | Path = "default", reduce: str = "auto", name: str = "UHead",
                 allow_other_weights: bool = False):
        super().__init__(head_path, ["uhead_sequence_features", "uhead_claim_features"], "sequence", name,
                         allow_other_weights)
        if reduce == "auto":
            usage = self.head.usage
            reduce = "max" if usage is not None and usage.answer_scoring == "max_step" else "whole"
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {('auto',) + REDUCTIONS}, got {reduce!r}")
        self.reduce = reduce

    def __call__(self, stats: dict[str, Any]) -> np.ndarray:
        self._check(stats)
        if self.reduce == "whole":
            return self._proba(stats["uhead_sequence_features"])
        fn = _REDUCERS[self.reduce]
        out = []
        for feats in stats["uhead_claim_features"]:
            p = self._proba(feats)
            out.append(float(fn(p)) if len(p) and not np.isnan(p).all() else np.nan)
        return np.array(out)


def _last(values: np.ndarray) -> Any:
    return values[-1]


#: How a sequence estimator reduces its claims' P(wrong) to one value.
_REDUCERS: dict[str, Callable[[np.ndarray], Any]] = {"max": np.nanmax, "mean": np.nanmean, "last": _last}


class UHeadClaim(_HeadEstimator):
    """Claim-level P(wrong), one value per claim (step) of each answer."""

    def __init__(self, head_path: str | Path = "default", name: str = "UHeadClaim", allow_other_weights: bool = False):
        super().__init__(head_path, ["uhead_claim_features", "claims"], "claim", name, allow_other_weights)

    def __call__(self, stats: dict[str, Any]) -> list[list[float]]:
        self._check(stats)
        return [self._proba(feats).tolist() for feats in stats["uhead_claim_features"]]


class OutputLength(Estimator):
    """Number of generated tokens: the baseline any uncertainty score must beat on short answers."""

    def __init__(self):
        super().__init__(["greedy_tokens"], "sequence")

    def __str__(self) -> str:
        return "OutputLength"

    def __call__(self, stats: dict[str, Any]) -> np.ndarray:
        return np.array([float(len(t)) for t in stats["greedy_tokens"]])
