"""Ranking probe: a linear step scorer trained to order sibling candidates, not only to classify.

Best-of-n and beam search choose among candidates that share one prefix, so what matters is the
order *within* a step; a head fitted only to "is this step wrong" across questions mostly learns
how hard the question is (every sibling inherits it). This head fits one linear score ``s`` on
standardised pooled step features with two terms:

- a pairwise logistic loss over sibling pairs (same ``groups`` id) whose target values differ,
  weighted by the value gap: the ranking the search needs;
- a pointwise logistic loss on the binary label, so ``P(wrong) = sigmoid(-s)`` stays a probability
  (thinkbooster's validity ``1 - P(wrong)`` and the lm-polygraph estimators read it as one).

It is an ordinary :class:`UncertaintyHead`: ``predict_proba`` per step, safetensors storage, so
every consumer (``HeadScorer`` for thinkbooster's ``StepScorerUncertainty``, the main job, the
server) uses it unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from scipy.special import expit

from ..features import FeatureRecipe, Pooling, pool, pooled_dim
from .base import HeadMismatchError, StepsLike, UncertaintyHead, check_labels
from .token_inputs import TokenInputs, pooled_linear_inputs


def sibling_pairs(groups: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(better, worse, gap) index arrays of every pair in one group whose values differ."""
    better, worse, gap = [], [], []
    order = np.argsort(groups, kind="stable")
    bounds = np.flatnonzero(np.diff(groups[order])) + 1
    for idx in np.split(order, bounds):
        v = values[idx]
        i, j = np.triu_indices(len(idx), k=1)
        d = v[i] - v[j]
        keep = d != 0
        i, j, d = i[keep], j[keep], d[keep]
        better.append(np.where(d > 0, idx[i], idx[j]))
        worse.append(np.where(d > 0, idx[j], idx[i]))
        gap.append(np.abs(d))
    if not better:
        return np.zeros(0, int), np.zeros(0, int), np.zeros(0)
    return np.concatenate(better), np.concatenate(worse), np.concatenate(gap)


class RankingProbeHead(UncertaintyHead):
    """Linear score on pooled step features; pairwise (siblings) + pointwise logistic losses.

    ``pair_weight`` balances the two losses (0 = a plain logistic probe); ``l2`` is the weight
    decay on the standardised coefficients (hidden states are wide); ``epochs`` of full-batch
    L-BFGS. ``fit`` without ``groups``/``values`` trains the pointwise term only.
    """

    head_type = "ranking_probe"
    aliases = ("ranking",)
    _param_names = ("pair_weight", "l2", "epochs")

    def __init__(
        self,
        recipe: FeatureRecipe | dict[str, Any] | None = None,
        model_identity: dict[str, Any] | None = None,
        pair_weight: float = 1.0,
        l2: float = 1e-3,
        epochs: int = 200,
    ):
        super().__init__(recipe, model_identity)
        self.pair_weight = pair_weight
        self.l2 = l2
        self.epochs = epochs

    @property
    def pooling(self) -> Pooling:
        return self.recipe.pooling if self.recipe else "mean"

    def pooled(self, steps: StepsLike, fitting: bool = False) -> np.ndarray:
        """``[n, D]`` pooled features of ``steps`` (what the linear score reads)."""
        tensors = self._as_steps(steps, fitting=fitting)
        return torch.stack([pool(s, self.pooling) for s in tensors]).to(torch.float64).numpy()

    def fit(self, steps: StepsLike, labels: Any, groups: Any = None, values: Any = None) -> "RankingProbeHead":
        """``labels`` 1 = wrong; ``groups`` sibling-group id per step; ``values`` how good each
        step is (e.g. the fraction of rollouts from it that reach the right answer)."""
        x = self.pooled(steps, fitting=True)
        self.n_features_in_ = int(torch.as_tensor(steps[0]).shape[1])
        return self.fit_pooled(x, labels, groups, values)

    def fit_pooled(self, x: np.ndarray, labels: Any, groups: Any = None, values: Any = None) -> "RankingProbeHead":
        """:meth:`fit` on features already pooled with this head's pooling (``[n, D]``)."""
        y = check_labels(labels, len(x))
        if not hasattr(self, "n_features_in_"):
            dim = x.shape[1] // 2 if self.pooling == "mean_last" else x.shape[1]
            self.n_features_in_ = int(dim)
        mean = x.mean(axis=0)
        scale = x.std(axis=0)
        scale[scale == 0] = 1.0
        z = torch.from_numpy((x - mean) / scale)
        if groups is not None and values is not None:
            b, w, gap = sibling_pairs(np.asarray(groups), np.asarray(values, dtype=np.float64))
        else:
            b = w = np.zeros(0, int)
            gap = np.zeros(0)
        wrong = torch.from_numpy(y.astype(np.float64))
        # Balanced pointwise weights: wrong/right ratios differ a lot between tasks and steps.
        pos = max(float(wrong.sum()), 1.0)
        neg = max(float(len(y) - wrong.sum()), 1.0)
        point_w = torch.where(wrong > 0, len(y) / (2 * pos), len(y) / (2 * neg))
        bt, wt, gt = torch.from_numpy(b), torch.from_numpy(w), torch.from_numpy(gap)
        coef = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
        bias = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([coef, bias], max_iter=self.epochs, line_search_fn="strong_wolfe")

        def loss_fn() -> torch.Tensor:
            opt.zero_grad()
            s = z @ coef + bias  # score = log-odds of "right"
            point = (point_w * torch.nn.functional.softplus(torch.where(wrong > 0, s, -s))).mean()
            loss = point + self.l2 * coef.pow(2).sum()
            if len(bt):
                pair = (gt * torch.nn.functional.softplus(s[wt] - s[bt])).sum() / gt.sum()
                loss = loss + self.pair_weight * pair
            loss.backward()
            return loss

        opt.step(loss_fn)  # returns the loss *before* its iterations
        final = float(loss_fn().detach())
        self.scaler_mean_ = mean
        self.scaler_scale_ = scale
        self.coef_ = coef.detach().numpy().copy()
        self.intercept_ = float(bias.detach()[0])
        self.training_summary_ = {
            "n_steps": int(len(y)),
            "n_wrong": int(y.sum()),
            "n_pairs": int(len(b)),
            "final_loss": final,
            "pooling": self.pooling,
        }
        return self

    def decision_pooled(self, x: np.ndarray) -> np.ndarray:
        """Logit of P(wrong) for pooled features ``[n, D]``."""
        self._check_fitted()
        return -(((x - self.scaler_mean_) / self.scaler_scale_) @ self.coef_ + self.intercept_)

    def decision_function(self, steps: StepsLike) -> np.ndarray:
        """Logit of P(wrong) per step."""
        return self.decision_pooled(self.pooled(steps))

    def predict_proba(self, steps: StepsLike) -> np.ndarray:
        return expit(self.decision_function(steps))

    def token_inputs(self) -> TokenInputs:
        layers, topk = self._reads()
        return pooled_linear_inputs(layers, self.n_features_in_, topk, self.pooling, self.coef_,
                                    self.scaler_scale_, self.scaler_mean_, self.intercept_, sign=-1.0)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {
            "scaler_mean": torch.from_numpy(np.asarray(self.scaler_mean_, dtype=np.float64)),
            "scaler_scale": torch.from_numpy(np.asarray(self.scaler_scale_, dtype=np.float64)),
            "coef": torch.from_numpy(np.asarray(self.coef_, dtype=np.float64)),
            "intercept": torch.tensor([self.intercept_], dtype=torch.float64),
        }

    def _set_weights(self, weights: dict[str, torch.Tensor], n_features: int) -> None:
        want = pooled_dim(n_features, self.pooling)
        for key in ("scaler_mean", "scaler_scale", "coef"):
            have = tuple(weights[key].shape)
            if have != (want,):
                raise HeadMismatchError(f"weight {key!r} has shape {have} but {n_features} features with "
                                        f"pooling {self.pooling!r} need ({want},)")
        self.scaler_mean_ = weights["scaler_mean"].numpy()
        self.scaler_scale_ = weights["scaler_scale"].numpy()
        self.coef_ = weights["coef"].numpy()
        self.intercept_ = float(weights["intercept"][0])
