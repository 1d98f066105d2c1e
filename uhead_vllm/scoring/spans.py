"""A head on spans of one answer: the answer's tensors, a span's feature matrix, the answer's
P(wrong) from its steps or its whole span. Shared by the main job, the server and the study."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..features import FeatureRecipe, StepSpan, clip_span, sampled_token_logprobs, step_token_features, topk_logprob_rows
from ..heads import UncertaintyHead


@dataclass
class AnswerArrays:
    """The tensors of one answer's generated tokens: ``hidden`` ``[rows, L, H]`` (row ``r`` = state
    after reading generated token ``r``; the last sampled token has none), ``token_ids`` ``[T]``,
    ``token_logprobs`` ``[T]`` (logprob of each sampled token), ``topk_logprobs`` ``[T, k]``."""

    hidden: torch.Tensor
    token_ids: torch.Tensor
    token_logprobs: torch.Tensor
    topk_logprobs: torch.Tensor


@dataclass
class SpanBatch:
    """Feature matrices of spans (``[t, F]`` each) with the id of the answer each comes from."""

    features: list[torch.Tensor] = field(default_factory=list)
    answer_ids: list[str] = field(default_factory=list)


def logprob_arrays(output: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_logprobs [T], topk_logprobs [T, k])`` of one vLLM CompletionOutput."""
    if output.logprobs is None:
        raise ValueError("the output has no logprobs: generate with SamplingParams(logprobs=k)")
    ids = list(output.token_ids)
    if len(output.logprobs) != len(ids):
        raise ValueError(f"{len(output.logprobs)} logprob entries for {len(ids)} tokens")
    return sampled_token_logprobs(ids, output.logprobs), topk_logprob_rows(output.logprobs, k)


def span_features(arrays: AnswerArrays, span: StepSpan, recipe: FeatureRecipe,
                  layers: Sequence[int]) -> torch.Tensor | None:
    """``[t, F]`` features of ``span`` from generated-token rows; None if no row is left."""
    clipped = clip_span(span, 0, arrays.hidden.shape[0])
    if clipped is None:
        return None
    topk = arrays.topk_logprobs if recipe.logprob_topk else None
    return step_token_features(arrays.hidden, 0, clipped, recipe, topk, captured_layers=layers)


class Spans(Protocol):
    """Aligned span features and the id of the answer each comes from (a :class:`SpanBatch`, the
    study's ``Examples``)."""

    features: list[torch.Tensor]
    answer_ids: list[str]


def answer_scores(head: UncertaintyHead, answers: Spans, steps: Spans, rule: str,
                  step_probs: np.ndarray | None = None) -> np.ndarray:
    """P(wrong) of each answer by ``rule`` (:attr:`HeadUsage.answer_scoring`): ``span``, the head on
    the whole answer; ``max_step``, the max over the answer's steps (``step_probs``: the head's
    P(wrong) of ``steps``, when the caller already has them). ``answers`` / ``steps``: anything with
    aligned ``features`` and ``answer_ids`` (a :class:`SpanBatch`, the study's ``Examples``)."""
    if rule == "span":
        return head.predict_proba(answers.features)
    if rule == "max_step":
        probs = head.predict_proba(steps.features) if step_probs is None else step_probs
        best: dict[str, float] = {}
        for aid, p in zip(steps.answer_ids, probs):
            best[aid] = max(best.get(aid, 0.0), float(p))
        missing = [a for a in answers.answer_ids if a not in best]
        if missing:
            raise ValueError(f"{len(missing)} answers have no scorable step (e.g. {missing[0]})")
        return np.array([best[a] for a in answers.answer_ids])
    raise ValueError(f"unknown answer scoring rule {rule!r}; expected 'span' or 'max_step'")
