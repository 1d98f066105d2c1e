"""Evaluation of uncertainty scores: ROC-AUC, prediction-rejection ratio, calibration, plots.

Conventions: ``labels_wrong`` is 1 when the answer/step is wrong; ``uncertainty`` is higher when
the model is less sure (e.g. a head's P(wrong)). Degenerate inputs (one class only, where a
metric is undefined) raise ``ValueError`` rather than returning a silently misleading number.
Plots draw on a private Agg canvas (no pyplot, no global backend switch) and write PNG files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
from sklearn.metrics import average_precision_score, roc_auc_score


def _arrays(labels: Any, scores: Any, name: str = "scores") -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels)
    s = np.asarray(scores, dtype=np.float64)
    if y.ndim != 1 or s.shape != y.shape:
        raise ValueError(f"labels and {name} must be 1-D of equal length, got {y.shape} and {s.shape}")
    if y.size == 0:
        raise ValueError("empty input")
    if not np.isin(y, (0, 1)).all():
        raise ValueError("labels must be 0 or 1")
    if not np.isfinite(s).all():
        raise ValueError(f"{name} contain NaN or inf")
    return y.astype(np.int64), s


def _need_both_classes(y: np.ndarray, metric: str) -> None:
    if y.min() == y.max():
        raise ValueError(f"{metric} is undefined when all labels are {int(y[0])} (one class only)")


def roc_auc(labels: Any, scores: Any) -> float:
    """ROC-AUC of ``scores`` ranking label-1 items first (ties count half).

    For uncertainty evaluation call ``roc_auc(labels_wrong, uncertainty)``. Raises ValueError with
    one class only.
    """
    y, s = _arrays(labels, scores)
    _need_both_classes(y, "ROC-AUC")
    return float(roc_auc_score(y, s))


def pr_auc(labels: Any, scores: Any) -> float:
    """Area under the precision-recall curve of ``scores`` finding label-1 items (average
    precision; chance level = the share of label 1). ``pr_auc(step_wrong, uncertainty)`` is the
    step metric of process-reward and step-head papers. Raises ValueError with one class only."""
    y, s = _arrays(labels, scores)
    _need_both_classes(y, "PR-AUC")
    return float(average_precision_score(y, s))


def rejection_curve(labels_wrong: Any, uncertainty: Any, max_rejection: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Quality of the kept items as the most uncertain ones are rejected first.

    Quality = mean correctness (1 - wrong) of what is kept. Returns ``(rejected_fraction, quality)``
    at rejection fractions k/n for k = 0 .. while k/n < max_rejection. Items with equal uncertainty
    are given their group's mean correctness, i.e. the expected curve under random tie-breaking, so
    a constant uncertainty yields exactly the random curve.
    """
    y, u = _arrays(labels_wrong, uncertainty, "uncertainty")
    if not 0.0 < max_rejection <= 1.0:
        raise ValueError(f"max_rejection must be in (0, 1], got {max_rejection}")
    n = y.size
    order = np.argsort(-u, kind="stable")
    u_sorted, correct = u[order], 1.0 - y[order].astype(np.float64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(u_sorted) != 0) + 1])
    counts = np.diff(np.concatenate([starts, [n]]))
    correct = np.repeat(np.add.reduceat(correct, starts) / counts, counts)
    kept_sum = np.cumsum(correct[::-1])[::-1]  # sum of correctness over items k..n-1
    k = np.arange(n)
    k = k[k / n < max_rejection]
    return k / n, kept_sum[k] / (n - k)


def _curve_area(quality: np.ndarray, n: int) -> float:
    return float(quality.sum() / n)


def prr(labels_wrong: Any, uncertainty: Any, max_rejection: float = 1.0) -> float:
    """Prediction-rejection ratio.

    With rejection curves as in :func:`rejection_curve` (quality = correctness, most uncertain
    rejected first) and their areas over rejection fractions [0, max_rejection):

        PRR = (AUC_unc - AUC_rand) / (AUC_oracle - AUC_rand)

    where the random curve is flat at the overall accuracy and the oracle rejects all wrong items
    first. 1 = as good as the oracle, 0 = no better than random, < 0 = worse than random.
    Raises ValueError with one class only (oracle == random, ratio undefined).
    """
    y, u = _arrays(labels_wrong, uncertainty, "uncertainty")
    _need_both_classes(y, "PRR")
    n = y.size
    _, q_unc = rejection_curve(y, u, max_rejection)
    _, q_oracle = rejection_curve(y, y.astype(np.float64), max_rejection)
    auc_rand = float(1.0 - y.mean()) * q_unc.size / n
    auc_unc, auc_oracle = _curve_area(q_unc, n), _curve_area(q_oracle, n)
    return (auc_unc - auc_rand) / (auc_oracle - auc_rand)


def expected_calibration_error(labels: Any, probs: Any, n_bins: int = 10) -> float:
    """ECE of ``probs`` = P(label 1), with equal-width bins on [0, 1]:
    sum over bins of (bin share) * |observed rate - mean predicted probability|.
    Defined for one class too (a calibrated model then predicts 0 or 1)."""
    y, p = _arrays(labels, probs, "probs")
    if (p < 0).any() or (p > 1).any():
        raise ValueError("probs must lie in [0, 1]")
    counts, observed, predicted = _bin_stats(y, p, n_bins)
    mask = counts > 0
    return float(np.sum(counts[mask] / y.size * np.abs(observed[mask] - predicted[mask])))


def _bin_stats(y: np.ndarray, p: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    bins = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    counts = np.bincount(bins, minlength=n_bins).astype(np.float64)
    safe = np.maximum(counts, 1)
    observed = np.bincount(bins, weights=y, minlength=n_bins) / safe
    predicted = np.bincount(bins, weights=p, minlength=n_bins) / safe
    return counts, observed, predicted


def _figure(ncols: int = 1, nrows: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    from .errors import require

    FigureCanvasAgg = require("matplotlib.backends.backend_agg", "Plotting (uhead_vllm.metrics)").FigureCanvasAgg
    Figure = require("matplotlib.figure", "Plotting (uhead_vllm.metrics)").Figure

    fig = Figure(figsize=kwargs.pop("figsize", (6, 4.5)), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kwargs)


def plot_rejection_curves(
    path: str | Path, curves: Mapping[str, tuple[Any, Any]], max_rejection: float = 1.0
) -> Path:
    """PNG of rejection curves ``{name: (labels_wrong, uncertainty)}`` with PRR in the legend,
    plus the oracle and random curves of the first entry's labels."""
    if not curves:
        raise ValueError("no curves to plot")
    fig, axes = _figure()
    ax = axes[0][0]
    first_labels = np.asarray(next(iter(curves.values()))[0])
    x, q = rejection_curve(first_labels, first_labels.astype(np.float64), max_rejection)
    ax.plot(x, q, "k--", label="oracle")
    ax.plot(x, np.full_like(x, 1.0 - first_labels.mean()), "k:", label="random")
    for name, (labels, unc) in curves.items():
        x, q = rejection_curve(labels, unc, max_rejection)
        ax.plot(x, q, label=f"{name} (PRR={prr(labels, unc, max_rejection):.3f})")
    ax.set(xlabel="rejected fraction (most uncertain first)", ylabel="accuracy of kept", title="Rejection curves")
    ax.legend(loc="lower right", fontsize="small")
    out = Path(path)
    fig.savefig(out, format="png", dpi=120)
    return out


def plot_calibration(path: str | Path, labels: Any, probs: Any, n_bins: int = 10) -> Path:
    """PNG reliability diagram (observed vs predicted rate per bin) with ECE, and bin counts."""
    y, p = _arrays(labels, probs, "probs")
    counts, observed, predicted = _bin_stats(y, p, n_bins)
    ece = expected_calibration_error(y, p, n_bins)
    fig, axes = _figure(nrows=2, figsize=(5, 6), gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    top, bottom = axes[0][0], axes[1][0]
    centers = (np.arange(n_bins) + 0.5) / n_bins
    mask = counts > 0
    top.plot([0, 1], [0, 1], "k--", label="perfect")
    top.bar(centers[mask], observed[mask], width=1.0 / n_bins, alpha=0.6, edgecolor="k", label="observed")
    top.plot(predicted[mask], observed[mask], "o-", color="C1", label="mean predicted")
    top.set(ylabel="observed rate of label 1", title=f"Calibration (ECE={ece:.3f})", xlim=(0, 1), ylim=(0, 1))
    top.legend(loc="upper left", fontsize="small")
    bottom.bar(centers, counts, width=1.0 / n_bins, edgecolor="k")
    bottom.set(xlabel="predicted probability", ylabel="count")
    out = Path(path)
    fig.savefig(out, format="png", dpi=120)
    return out
