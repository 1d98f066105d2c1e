"""Statistics of the value study: paired bootstrap intervals and step-ranking metrics."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...metrics import pr_auc, roc_auc
from ...heads.ranking import sibling_pairs


def paired_bootstrap(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, *, resamples: int = 10_000,
                     seed: int = 0) -> dict[str, float]:
    """Mean of ``a - b`` over paired items (questions) and its 95% percentile bootstrap interval."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError("paired_bootstrap needs two equal-length, non-empty 1-D sequences")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"delta": float(d.mean()), "lo": float(lo), "hi": float(hi)}


def bootstrap_mean(a: Sequence[float] | np.ndarray, *, resamples: int = 10_000, seed: int = 0) -> dict[str, float]:
    """Mean of ``a`` and its 95% percentile bootstrap interval."""
    r = paired_bootstrap(a, np.zeros(len(a)), resamples=resamples, seed=seed)
    return {"mean": r["delta"], "lo": r["lo"], "hi": r["hi"]}


def within_group_accuracy(groups: Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray,
                          validity: Sequence[float] | np.ndarray) -> float:
    """Share of sibling pairs with different values that ``validity`` orders right (ties: half)."""
    v = np.asarray(validity, dtype=np.float64)
    b, w, _ = sibling_pairs(np.asarray(groups), np.asarray(values, dtype=np.float64))
    if not len(b):
        raise ValueError("no sibling pairs with different values")
    diff = v[b] - v[w]
    return float(((diff > 0) + 0.5 * (diff == 0)).mean())


def step_metrics(groups: Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray,
                 validity: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    """ROC-AUC and PR-AUC of "step wrong" (value 0) against 1 - validity, PR-AUC of "step right"
    against validity (the minority class when most steps are wrong, where PR-AUC of "wrong" sits
    near its chance level for every scorer), and within-step accuracy.

    A metric that is undefined on this data (one class only, no sibling pair that differs) is
    None, never a made-up number.
    """
    wrong = (np.asarray(values) == 0).astype(int)
    u = 1.0 - np.asarray(validity, dtype=np.float64)
    out: dict[str, float | None] = {"pr_auc_chance": float(wrong.mean()), "pr_auc_right_chance": float(1 - wrong.mean())}
    for name, fn in (("roc_auc", lambda: roc_auc(wrong, u)), ("pr_auc", lambda: pr_auc(wrong, u)),
                     ("pr_auc_right", lambda: pr_auc(1 - wrong, -u)),
                     ("within_step_pairwise", lambda: within_group_accuracy(groups, values, validity))):
        try:
            out[name] = fn()
        except ValueError:
            out[name] = None
    return out
