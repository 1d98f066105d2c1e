"""Step scorers: turn one candidate step into an uncertainty ``u >= 0`` for thinkbooster.

thinkbooster's vLLM step generator converts whatever ``model.score(...)`` returns into
``validity = 1 / (1 + u)``. Every scorer here returns such a ``u``:

- :class:`HeadScorer` — an uncertainty head's P(wrong) ``p`` on the hidden states of exactly the
  step's tokens, mapped to ``u = p / (1 - p)`` (the odds of being wrong), so that
  ``validity = 1 / (1 + u) = 1 - p``: the validity thinkbooster sees *is* the head's P(correct).
- :class:`MeanTokenEntropyScorer` / :class:`MeanNLLScorer` — logprob baselines, ``u`` = mean token
  entropy / mean negative log-likelihood of the step's tokens (validity is monotone in ``u``, so
  ranking candidates by validity ranks them by the baseline).
- :class:`RandomScorer` — a seeded uniform ``u``: random candidate choice through the same path.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..features import StepSpan, sampled_token_logprobs, step_token_features, topk_logprob_rows
from ..heads import UncertaintyHead


@dataclass
class CandidateStep:
    """What a scorer sees of one candidate step.

    ``span`` is a half-open range of *generated*-token positions; ``hidden`` holds the rows of
    the generated tokens only (``hidden[j]`` = state after reading generated token ``j``, layers
    in ``layers`` order), ``logprobs`` is vLLM's per-token list of ``{token_id: Logprob}``.
    """

    output_token_ids: list[int]
    span: StepSpan
    hidden: torch.Tensor | None  # [n_rows, L, H] for generated positions, or None
    layers: tuple[int, ...]
    logprobs: Sequence[dict[int, Any]] | None

    @property
    def token_ids(self) -> list[int]:
        return self.output_token_ids[self.span.start : self.span.end]


class StepScorer(Protocol):
    """Maps a candidate step to an uncertainty ``u >= 0`` (validity = 1 / (1 + u))."""

    name: str
    needs_hidden: bool

    def uncertainty(self, step: CandidateStep) -> float: ...


# ---------------------------------------------------------------------------------------------
# Uncertainty head
# ---------------------------------------------------------------------------------------------


def probability_to_uncertainty(p: float, eps: float = 1e-6) -> float:
    """Odds of being wrong, ``p / (1 - p)``; ``1 / (1 + u)`` gives back ``1 - p`` (p clipped to [eps, 1-eps])."""
    if not math.isfinite(p) or p < 0.0 or p > 1.0:
        raise ValueError(f"P(wrong) must be a probability in [0, 1], got {p!r}")
    p = min(max(p, eps), 1.0 - eps)
    return p / (1.0 - p)


class HeadScorer:
    """Uncertainty head on the per-token features of exactly the candidate's step tokens."""

    name = "head"
    needs_hidden = True

    def __init__(self, head: UncertaintyHead, eps: float = 1e-6):
        if head.recipe is None:
            raise ValueError("the head has no FeatureRecipe; it cannot say which layers it reads")
        self.head = head
        self.recipe = head.recipe
        self.eps = eps

    @property
    def layers(self) -> list[int]:
        return list(self.recipe.layers)

    def features(self, step: CandidateStep) -> torch.Tensor:
        """``[len(span), F]`` features exactly as the head was trained on (``step_token_features``)."""
        if step.hidden is None:
            raise ValueError("this candidate has no hidden states; generate it through UHeadVLLMModel")
        topk = None
        if self.recipe.logprob_topk:
            if step.logprobs is None:
                raise ValueError(f"the head needs top-{self.recipe.logprob_topk} logprobs; none were returned")
            topk = topk_logprob_rows(step.logprobs, self.recipe.logprob_topk, step.span.start, step.span.end)
        # Offset the rows by span.start so that the top-k matrix covers exactly the span.
        local = StepSpan(0, len(step.span))
        return step_token_features(step.hidden, step.span.start, local, self.recipe, topk,
                                   captured_layers=step.layers)

    def features_batch(self, steps: Sequence[CandidateStep], chunk: int = 1024) -> list[torch.Tensor]:
        """``[self.features(s) for s in steps]``, with a few tensor operations per ``chunk`` steps
        instead of a few per step: a best-of-n step scores thousands of candidates, and on a busy
        host each small operation costs far more than its arithmetic. The steps' rows are
        concatenated and go through the same :func:`step_token_features`; steps that do not fit
        one batch (other captured layers, a span past their rows) are done one by one, so their
        errors are the per-step ones. The returned tensors are views of one tensor per chunk."""
        out: list[torch.Tensor | None] = [None] * len(steps)
        batchable: list[int] = []
        k = self.recipe.logprob_topk
        ref = steps[0].hidden if steps else None
        for i, st in enumerate(steps):
            if (ref is not None and st.hidden is not None and st.layers == steps[0].layers
                    and st.hidden.shape[1:] == ref.shape[1:] and st.hidden.dtype == ref.dtype
                    and 0 < len(st.span) and st.span.end <= st.hidden.shape[0] and (not k or st.logprobs is not None)):
                batchable.append(i)
            else:
                out[i] = self.features(st)
        for lo in range(0, len(batchable), chunk):
            part = [steps[i] for i in batchable[lo : lo + chunk]]
            rows = torch.cat([_span_rows(st) for st in part])
            topk = (torch.cat([topk_logprob_rows(_require_logprobs(st), k, st.span.start, st.span.end) for st in part])
                    if k else None)
            feats = step_token_features(rows, 0, StepSpan(0, rows.shape[0]), self.recipe, topk,
                                        captured_layers=part[0].layers)
            for i, f in zip(batchable[lo : lo + chunk], feats.split([len(st.span) for st in part])):
                out[i] = f
        return out  # type: ignore[return-value]

    def probability(self, step: CandidateStep) -> float:
        """The head's P(step is wrong)."""
        return float(self.head.predict_proba([self.features(step)])[0])

    def uncertainty(self, step: CandidateStep) -> float:
        return probability_to_uncertainty(self.probability(step), self.eps)


# ---------------------------------------------------------------------------------------------
# Logprob baselines and random choice
# ---------------------------------------------------------------------------------------------


def _require_logprobs(step: CandidateStep) -> Sequence[dict[int, Any]]:
    if step.logprobs is None:
        raise ValueError("this scorer needs logprobs; request SamplingParams(logprobs=k) from vLLM")
    return step.logprobs


def _span_logprobs(step: CandidateStep) -> list[dict[int, Any]]:
    logprobs = _require_logprobs(step)
    if len(logprobs) < step.span.end:
        raise ValueError(f"logprobs cover {len(logprobs)} tokens, the step needs {step.span.end}")
    return [logprobs[p] for p in range(step.span.start, step.span.end)]


def _span_rows(step: CandidateStep) -> torch.Tensor:
    if step.hidden is None:
        raise ValueError("this scorer needs the step's hidden states")
    return step.hidden[step.span.start : step.span.end]


class MeanTokenEntropyScorer:
    """Mean over the step's tokens of the entropy of the returned alternatives (top-k + sampled).

    vLLM only returns the top-k, so this is the entropy truncated to those k tokens (no
    renormalisation), as lm-polygraph computes it from vLLM logprobs.
    """

    name = "mean_token_entropy"
    needs_hidden = False

    def uncertainty(self, step: CandidateStep) -> float:
        ents = []
        for d in _span_logprobs(step):
            lp = np.array([float(getattr(v, "logprob", v)) for v in d.values()], dtype=np.float64)
            lp = lp[np.isfinite(lp)]
            ents.append(float(-(np.exp(lp) * lp).sum()))
        return float(np.mean(ents))


class MeanNLLScorer:
    """Mean negative log-probability of the step's sampled tokens (log-perplexity)."""

    name = "mean_nll"
    needs_hidden = False

    def uncertainty(self, step: CandidateStep) -> float:
        lp = sampled_token_logprobs(step.output_token_ids, _require_logprobs(step), step.span.start, step.span.end)
        return float(-lp.double().mean())


class RandomScorer:
    """Seeded uniform ``u`` in [0, 1): candidate choice at random, through the same code path."""

    name = "random"
    needs_hidden = False

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def uncertainty(self, step: CandidateStep) -> float:
        return self.rng.random()


SCORERS: dict[str, type] = {
    "head": HeadScorer,
    "mean_token_entropy": MeanTokenEntropyScorer,
    "entropy": MeanTokenEntropyScorer,
    "mean_nll": MeanNLLScorer,
    "random": RandomScorer,
}
