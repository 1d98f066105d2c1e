"""Logprob baselines, computed on exactly the tokens the heads see (answers or steps).

Every score is an *uncertainty* (higher = less sure), so it plugs into the same metrics as a
head's P(wrong):

- ``msp``: maximum sequence probability, ``-sum(log p(token))`` over the span (lm-polygraph's
  MaximumSequenceProbability convention);
- ``perplexity``: ``exp(-mean(log p(token)))``;
- ``mean_entropy``: mean per-token entropy. vLLM only returns the top-k logprobs, so the entropy
  is the *top-k truncated* entropy ``-sum_{i<=k} p_i log p_i`` — a lower bound of the true entropy
  (it ignores the tail mass); an approximation, reported as such;
- ``length``: number of tokens (output length alone is a strong signal on these tasks).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

BASELINES: tuple[str, ...] = ("msp", "perplexity", "mean_entropy", "length")


def topk_entropy(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token truncated entropy from ``[T, k]`` top-k logprobs (``-inf`` entries contribute 0)."""
    lp = topk_logprobs.to(torch.float64)
    p = lp.exp()
    return -(p * torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp))).sum(dim=-1)


def span_baselines(token_logprobs: torch.Tensor, topk_logprobs: torch.Tensor,
                   start: int = 0, end: int | None = None) -> dict[str, float]:
    """Baseline uncertainties of generated tokens ``[start, end)`` (default: the whole answer)."""
    end = token_logprobs.shape[0] if end is None else end
    if not 0 <= start < end <= token_logprobs.shape[0]:
        raise ValueError(f"span [{start}, {end}) is empty or outside {token_logprobs.shape[0]} tokens")
    lp = token_logprobs[start:end].to(torch.float64)
    if not torch.isfinite(lp).all():
        raise ValueError("token logprobs contain NaN or -inf; the span cannot be scored")
    ent = topk_entropy(topk_logprobs[start:end])
    nll = float(-lp.sum())
    return {
        "msp": nll,
        "perplexity": math.exp(nll / (end - start)),
        "mean_entropy": float(ent.mean()),
        "length": float(end - start),
    }


def spans_baselines(token_logprobs: torch.Tensor, topk_logprobs: torch.Tensor,
                    spans: Sequence[tuple[int, int]]) -> list[dict[str, float]]:
    """:func:`span_baselines` for each ``(start, end)`` span."""
    return [span_baselines(token_logprobs, topk_logprobs, s, e) for s, e in spans]
