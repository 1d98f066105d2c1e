"""A head's inputs per token, reduced where the rows are: the linear map every shipped head applies to
a token's hidden-state features before anything nonlinear.

A step's features are ``[t, F]``: the recipe's layers concatenated (``R = L * H`` values per token),
then ``k`` top-k logprobs (features.py). Every shipped head reads the hidden-state part only through
a linear map:

- the pooled linear heads (linear probe, ranking probe) standardise the pooled vector and take a dot
  product; mean and last pooling commute with it, so a step's logit needs one number per token per
  pooled part (1 for ``mean`` or ``last``, 2 for ``mean_last``);
- the attention head standardises each token and applies ``in_proj`` before its network: ``d_model``
  numbers per token.

So a token's ``R`` hidden-state values can be reduced to ``D`` numbers on the device that computed
them (``D`` = 1-2 or ``d_model`` against ``R`` = thousands), and only those cross to the host.
:class:`TokenInputs` is the map; :meth:`TokenInputs.decide` finishes the head's logit from the
reduced inputs and the logprob features, equal to the head's ``decision_function`` on the full
features up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..capture.token_weight import save_weight
from ..features import Pooling

#: Finishes the logits of a batch of steps from their reduced inputs ``[t, D]`` and logprob features ``[t, k]``.
Finish = Callable[[list[torch.Tensor], list[torch.Tensor]], np.ndarray]


@dataclass(frozen=True)
class TokenInputs:
    """``weight [D, L * H]`` (float32) maps a token's hidden-state features (the recipe's ``layers``
    in recipe order, concatenated) to the head's ``D`` reduced inputs; ``finish`` completes the logits."""

    layers: tuple[int, ...]
    weight: torch.Tensor
    logprob_topk: int
    finish: Finish

    @property
    def width(self) -> int:
        """``D``: numbers per token that cross to the host."""
        return int(self.weight.shape[0])

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:
        """``[T, D]`` float32 reduced inputs of rows ``[T, L, H]`` (or ``[T, L * H]``) holding the
        recipe's layers in recipe order, computed on the rows' device."""
        flat = rows.reshape(rows.shape[0], -1).to(torch.float32)
        if flat.shape[1] != self.weight.shape[1]:
            raise ValueError(f"rows have {flat.shape[1]} values per token; this head reads {self.weight.shape[1]}")
        return flat @ self.weight.to(flat.device).T

    def decide(self, inputs: Sequence[torch.Tensor], logprobs: Sequence[torch.Tensor] | None = None) -> np.ndarray:
        """Logits of P(wrong), one per step, from each step's reduced inputs ``[t, D]`` and (when
        the recipe reads logprobs) its top-k logprob features ``[t, >= k]``."""
        steps = [torch.as_tensor(u).to(torch.float32) for u in inputs]
        if not steps or any(u.dim() != 2 or u.shape[0] == 0 or u.shape[1] != self.width for u in steps):
            raise ValueError(f"inputs must be non-empty [t, {self.width}] matrices, one per step")
        k = self.logprob_topk
        if k and (logprobs is None or len(logprobs) != len(steps)):
            raise ValueError(f"this head reads top-{k} logprobs: pass one [t, {k}] matrix per step")
        lps = [torch.zeros(len(u), 0) if not k else torch.as_tensor(lp)[:, :k].to(torch.float32)
               for u, lp in zip(steps, logprobs if k and logprobs is not None else [None] * len(steps))]
        if any(lp.shape[0] != u.shape[0] for u, lp in zip(steps, lps)):
            raise ValueError("each step's logprob features need one row per token")
        return self.finish(steps, lps)

    def save(self, path: str) -> None:
        """Write the weight and its layers as safetensors, the file a capturing worker loads
        (``CaptureSettings.token_inputs``)."""
        save_weight(path, self.layers, self.weight)


def pooled_linear_inputs(layers: Sequence[int], n_features: int, logprob_topk: int, pooling: Pooling,
                         coef: np.ndarray, scale: np.ndarray, mean: np.ndarray, intercept: float,
                         sign: float = 1.0) -> TokenInputs:
    """The inputs of a head whose logit is ``sign * (((pool(x) - mean) / scale) @ coef + intercept)``."""
    c = sign * np.asarray(coef, np.float64) / np.asarray(scale, np.float64)
    const = sign * float(intercept) - float(c @ np.asarray(mean, np.float64))
    parts = ["mean"] if pooling == "mean" else ["last"] if pooling == "last" else ["mean", "last"]
    f, r = n_features, n_features - logprob_topk
    weights = [c[i * f: i * f + r] for i in range(len(parts))]  # per pooled part, its hidden-state columns
    lp_weights = [torch.from_numpy(c[i * f + r: (i + 1) * f]) for i in range(len(parts))]

    def finish(steps: list[torch.Tensor], lps: list[torch.Tensor]) -> np.ndarray:
        out = np.empty(len(steps))
        for n, (u, lp) in enumerate(zip(steps, lps)):
            u, lp = u.to(torch.float64), lp.to(torch.float64)
            total = const
            for i, how in enumerate(parts):
                ui, lpi = (u[:, i].mean(), lp.mean(0)) if how == "mean" else (u[-1, i], lp[-1])
                total += float(ui) + float(lpi @ lp_weights[i])
            out[n] = total
        return out

    return TokenInputs(tuple(int(x) for x in layers), torch.from_numpy(np.stack(weights)).to(torch.float32),
                       logprob_topk, finish)
