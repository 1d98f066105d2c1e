"""Fit the ranking head on on-policy step data and measure every scorer on held-out steps."""

from __future__ import annotations

from itertools import product
from typing import Any, Callable, Sequence, cast

import numpy as np

from ...features import FeatureRecipe
from ...heads.ranking import RankingProbeHead
from .stats import step_metrics
from .steps import StepData, question_split

#: Searched on a question-level validation split; the best by within-step pairwise accuracy wins
#: (by ROC-AUC of "wrong" where the split has no sibling pair that differs; DEFAULT where neither
#: is defined).
GRID = {"l2": (1e-3, 1e-2, 1e-1), "pair_weight": (0.0, 1.0, 4.0)}
DEFAULT = {"l2": 1e-2, "pair_weight": 1.0}


def fit_ranking_head(data: StepData, layers: Sequence[int], *, seed: int = 0,
                     progress: Callable[[str], Any] | None = None) -> tuple[RankingProbeHead, list[dict]]:
    """The ranking head refitted on all of ``data`` with the best grid point; the search record."""
    say = progress or (lambda _m: None)
    recipe = FeatureRecipe(list(layers), pooling="mean_last", logprob_topk=10)
    x = data.features.double().numpy()
    fit_mask, val_mask = question_split(data, 0.2, seed)
    record = []
    for l2, pw in product(GRID["l2"], GRID["pair_weight"]):
        head = RankingProbeHead(recipe, l2=l2, pair_weight=pw)
        head.fit_pooled(x[fit_mask], data.wrong[fit_mask], data.groups[fit_mask], data.values[fit_mask])
        validity = 1.0 - _sigmoid(head.decision_pooled(x[val_mask]))
        m = step_metrics(data.groups[val_mask], data.values[val_mask], validity)
        record.append({"l2": l2, "pair_weight": pw, "val_within_step_pairwise": m["within_step_pairwise"],
                       "val_roc_auc": m["roc_auc"]})
        say(f"ranking head l2={l2:g} pair_weight={pw:g}: validation {m}")
    key = next((k for k in ("val_within_step_pairwise", "val_roc_auc") if record[0][k] is not None), None)
    # The chosen metric is defined at every grid point (the same validation steps), as l2 and pair_weight are.
    best = max(record, key=lambda r: cast(float, r[key])) if key else DEFAULT
    say(f"ranking head: {best} chosen by {key or 'default (no validation metric defined)'}")
    head = RankingProbeHead(recipe, l2=cast(float, best["l2"]), pair_weight=cast(float, best["pair_weight"]))
    head.fit_pooled(x, data.wrong, data.groups, data.values)
    return head, record


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def step_report(data: StepData, head: RankingProbeHead) -> dict[str, dict[str, float | None]]:
    """:func:`step_metrics` for the ranking head (from stored features) and every stored scorer."""
    scores = dict(data.validity)
    scores["head_rank"] = 1.0 - _sigmoid(head.decision_pooled(data.features.double().numpy()))
    return {name: step_metrics(data.groups, data.values, v) for name, v in sorted(scores.items())}
