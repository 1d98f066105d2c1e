"""Linear probe: standardised pooled step features -> balanced logistic regression.

The cheapest head that works, and the baseline every other head must beat. scikit-learn fits it;
prediction uses the learned arrays directly, so a saved-and-loaded probe (plain arrays in
safetensors, no pickled estimator) computes exactly what the fitted one did.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from scipy.special import expit
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from ..features import FeatureRecipe, Pooling, pool, pooled_dim
from .base import HeadMismatchError, StepsLike, UncertaintyHead, check_labels
from .token_inputs import TokenInputs, pooled_linear_inputs


class LinearProbeHead(UncertaintyHead):
    """Logistic regression on steps pooled with the recipe's pooling ("mean" without a recipe).

    ``C`` is the inverse L2 strength (hidden states are wide, so regularise); ``class_weight`` is
    always balanced because wrong/correct ratios vary a lot between tasks.
    """

    head_type = "linear_probe"
    aliases = ("linear",)
    _param_names = ("C", "max_iter")

    def __init__(
        self,
        recipe: FeatureRecipe | dict[str, Any] | None = None,
        model_identity: dict[str, Any] | None = None,
        C: float = 1.0,
        max_iter: int = 2000,
    ):
        super().__init__(recipe, model_identity)
        self.C = C
        self.max_iter = max_iter

    @property
    def pooling(self) -> Pooling:
        return self.recipe.pooling if self.recipe else "mean"

    def _pooled(self, steps: list[torch.Tensor]) -> np.ndarray:
        return torch.stack([pool(s, self.pooling) for s in steps]).to(torch.float64).numpy()

    def fit(self, steps: StepsLike, labels: Any) -> "LinearProbeHead":
        tensors = self._as_steps(steps, fitting=True)
        y = check_labels(labels, len(tensors))
        x = self._pooled(tensors)
        scaler = StandardScaler().fit(x)
        clf = LogisticRegression(C=self.C, max_iter=self.max_iter, class_weight="balanced")
        clf.fit(scaler.transform(x), y)
        self.scaler_mean_ = scaler.mean_.astype(np.float64)
        self.scaler_scale_ = scaler.scale_.astype(np.float64)
        self.coef_ = clf.coef_[0].astype(np.float64)  # classes_ == [0, 1]: positive class = wrong
        self.intercept_ = float(clf.intercept_[0])
        self.n_features_in_ = int(tensors[0].shape[1])
        self.training_summary_ = {
            "n_steps": len(tensors),
            "n_wrong": int(y.sum()),
            "n_iter": int(clf.n_iter_[0]),
            "pooling": self.pooling,
        }
        return self

    def decision_function(self, steps: StepsLike) -> np.ndarray:
        """Logit of P(wrong) per step."""
        x = self._pooled(self._as_steps(steps))
        return ((x - self.scaler_mean_) / self.scaler_scale_) @ self.coef_ + self.intercept_

    def predict_proba(self, steps: StepsLike) -> np.ndarray:
        return expit(self.decision_function(steps))

    def token_inputs(self) -> TokenInputs:
        layers, topk = self._reads()
        return pooled_linear_inputs(layers, self.n_features_in_, topk, self.pooling, self.coef_,
                                    self.scaler_scale_, self.scaler_mean_, self.intercept_)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {
            "scaler_mean": torch.from_numpy(self.scaler_mean_),
            "scaler_scale": torch.from_numpy(self.scaler_scale_),
            "coef": torch.from_numpy(self.coef_),
            "intercept": torch.tensor([self.intercept_], dtype=torch.float64),
        }

    def _set_weights(self, weights: dict[str, torch.Tensor], n_features: int) -> None:
        want = pooled_dim(n_features, self.pooling)
        for key in ("scaler_mean", "scaler_scale", "coef"):
            have = tuple(weights[key].shape)
            if have != (want,):
                raise HeadMismatchError(
                    f"weight {key!r} has shape {have} but {n_features} features with "
                    f"pooling {self.pooling!r} need ({want},)"
                )
        self.scaler_mean_ = weights["scaler_mean"].numpy()
        self.scaler_scale_ = weights["scaler_scale"].numpy()
        self.coef_ = weights["coef"].numpy()
        self.intercept_ = float(weights["intercept"][0])
