"""The head on one served sequence: the same scoring as the offline main job (``uhead-vllm answer``).

The final scores go through :func:`uhead_vllm.scoring.scored.score_generation` itself, fed with
the ids and logprobs vLLM returned and the sequence's exact rows, so a served answer gets the
same numbers as the offline job. :func:`score_spans` scores steps of a still-growing answer
(streaming) with the same features. Both give the head one step at a time, so a step's score
never depends on which other steps share its batch: streamed step scores equal the final ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, cast

import numpy as np
import torch

from ..features import FeatureRecipe, StepSpan, pool, split_steps, topk_logprob_rows
from ..heads import UncertaintyHead
from ..scoring.recipe import GenerationRecipe
from ..scoring.scored import score_generation
from ..scoring.spans import AnswerArrays, span_features


@dataclass
class _Output:
    token_ids: list[int]
    logprobs: list[Any]
    text: str
    finish_reason: str | None


@dataclass
class _Sample:
    rows: torch.Tensor  # generated-token rows [T_gen(-1), L, H]
    layers: tuple[int, ...]

    def generated_rows(self) -> torch.Tensor:
        return self.rows


class _OneStepAtATime:
    """The head, scoring each step alone. Batched, a step's score moves with its batch (matrix
    kernels and padding differ by batch shape, ~1e-7); alone, equal features give equal scores."""

    def __init__(self, head: UncertaintyHead):
        self._head = head

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)

    def predict_proba(self, steps: Sequence[torch.Tensor]) -> np.ndarray:
        return np.concatenate([self._head.predict_proba([s]) for s in steps]) if len(steps) else np.empty(0)


def step_dict(text: str, start: int, end: int, p: float | None) -> dict[str, Any]:
    return {"text": text, "token_start": start, "token_end": end, "p_wrong": p}


class Scorer:
    """A head with the recipe it was trained with (logprobs, step splitting)."""

    def __init__(self, head: UncertaintyHead, name: str, tokenizer: Any, layers: Sequence[int]):
        self.head = head
        self._stepwise = cast(UncertaintyHead, _OneStepAtATime(head))  # the head's own face, via __getattr__
        self.name = name
        self.tokenizer = tokenizer
        self.layers = tuple(layers)  # the captured layers, in the order rows carry them
        generation = head.require_usage(generation=True).generation
        assert generation is not None  # require_usage(generation=True) refuses a head without one
        self.recipe = GenerationRecipe(**generation)
        missing = [k for k in self._feature_recipe.layers if k not in self.layers]
        if missing:
            raise ValueError(f"the head needs layers {missing}, which the engine does not capture "
                             f"(captured: {list(self.layers)}); add them with --layers")

    @property
    def _feature_recipe(self) -> FeatureRecipe:
        """The head's feature recipe (a head without one cannot score)."""
        assert self.head.recipe is not None
        return self.head.recipe

    @property
    def logprobs_needed(self) -> int:
        return max(self.recipe.logprobs, self._feature_recipe.logprob_topk)

    def score(self, token_ids: list[int], logprobs: list[Any], text: str, finish_reason: str | None,
              generated_rows: torch.Tensor) -> dict[str, Any]:
        """``{answer_p_wrong, steps}`` of a finished sequence (P(wrong) None where no row exists)."""
        out = _Output(token_ids, logprobs, text, finish_reason)
        try:
            scored = score_generation(self._stepwise, out, _Sample(generated_rows, self.layers), self.tokenizer,
                                      self.recipe, "")
        except ValueError:  # e.g. a one-token answer: no generated row to score
            spans = split_steps(token_ids, self.tokenizer, mode=self.recipe.split_mode) if token_ids else []
            return {"answer_p_wrong": None, "steps": [
                step_dict(self._text(token_ids, s), s.start, s.end, None) for s in spans]}
        return {"answer_p_wrong": scored.uncertainty,
                "steps": [step_dict(s.text, s.start, s.end, s.uncertainty) for s in scored.steps]}

    def final_spans(self, token_ids: list[int]) -> list[StepSpan]:
        """Steps of a growing answer that can no longer change: all but the last one."""
        return split_steps(token_ids, self.tokenizer, mode=self.recipe.split_mode)[:-1] if token_ids else []

    def _token_features(self, token_ids: list[int], logprobs: list[Any], generated_rows: torch.Tensor,
                        spans: Sequence[StepSpan]) -> list[torch.Tensor | None]:
        """The head's per-token input features ``[t, F]`` of each span (None where no row exists)."""
        k = self._feature_recipe.logprob_topk
        topk = topk_logprob_rows(logprobs, k, 0, len(token_ids)) if k else torch.zeros(len(token_ids), 0)
        arrays = AnswerArrays(generated_rows, torch.tensor(token_ids, dtype=torch.int64),
                              torch.zeros(len(token_ids)), topk)
        return [span_features(arrays, s, self._feature_recipe, list(self.layers)) for s in spans]

    def pooled_features(self, token_ids: list[int], logprobs: list[Any], generated_rows: torch.Tensor,
                        steps: Sequence[dict[str, Any]]) -> list[list[float] | None]:
        """Each step's features as the head's recipe pools them (its layers, then top-k logprobs;
        ``pooling``), the vector a linear head reads: for people training their own heads."""
        spans = [StepSpan(s["token_start"], s["token_end"]) for s in steps]
        feats = self._token_features(token_ids, logprobs[: len(token_ids)], generated_rows, spans)
        return [None if f is None else pool(f, self._feature_recipe.pooling).tolist() for f in feats]

    def score_spans(self, token_ids: list[int], logprobs: list[Any], generated_rows: torch.Tensor,
                    spans: Sequence[StepSpan]) -> list[dict[str, Any]]:
        """Scores of complete steps of a growing answer (their rows all exist already)."""
        feats = self._token_features(token_ids, logprobs, generated_rows, spans)
        probs = iter(self._stepwise.predict_proba([f for f in feats if f is not None])
                     if any(f is not None for f in feats) else np.empty(0))
        return [step_dict(self._text(token_ids, s), s.start, s.end, None if f is None else float(next(probs)))
                for s, f in zip(spans, feats)]

    def _text(self, ids: list[int], s: StepSpan) -> str:
        return self.tokenizer.decode(ids[s.start : s.end], skip_special_tokens=True)

    def step_boundary_possible(self, new_text: str) -> bool:
        """Cheap pre-check before re-splitting a growing answer: could a step have ended?"""
        if "\n" in new_text:
            return True
        return self.recipe.split_mode == "sentence" and any(c in new_text for c in ".!?")
