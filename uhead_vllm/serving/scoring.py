"""The head on one served sequence: the same scoring as the offline main job (``uhead-vllm answer``).

The final scores go through :func:`uhead_vllm.scoring.scored.score_generation` itself, fed with
the ids and logprobs vLLM returned and the sequence's exact rows, so a served answer gets the
same numbers as the offline job. :func:`score_spans` scores steps of a still-growing answer
(streaming) with the same features. Both give the head one step at a time, so a step's score
never depends on which other steps share its batch: streamed step scores equal the final ones.

On a server whose worker reduces rows to the head's inputs (``serve --scores-on-device``), a
sequence's rows are ``[rows, 1, D]``: the head's :class:`~uhead_vllm.heads.token_inputs.TokenInputs`
of each token. The scorer then hands :func:`score_generation` a facade head that reads those rows
as one pseudo layer (``D`` values, then the top-k logprobs) and finishes the head's logit from them
(``TokenInputs.decide``): the same scoring path, the head's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, cast

import numpy as np
import torch
from scipy.special import expit

from ..features import AnswerOffsets, FeatureRecipe, StepSpan, pool, split_steps, topk_logprob_rows
from ..heads import UncertaintyHead
from ..heads.token_inputs import TokenInputs
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


#: The one column of a reduced server's rows, as the facade's recipe names it.
REDUCED_LAYER = 0


class ReducedHead:
    """The head, scoring steps from its reduced inputs: features ``[t, D + k]`` (the row's ``D``
    inputs, then ``k`` top-k logprobs) under a recipe of one pseudo layer. Each step alone, as
    :class:`_OneStepAtATime`."""

    def __init__(self, head: UncertaintyHead, inputs: TokenInputs):
        assert head.recipe is not None  # a head with token inputs has a recipe (token_inputs() checks)
        self._head, self.inputs = head, inputs
        self.recipe = FeatureRecipe([REDUCED_LAYER], head.recipe.pooling, inputs.logprob_topk)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)

    def predict_proba(self, steps: Sequence[torch.Tensor]) -> np.ndarray:
        d = self.inputs.width
        logits = [self.inputs.decide([f[:, :d]], [f[:, d:]]) for f in steps]
        return expit(np.concatenate(logits)) if logits else np.empty(0)


def step_dict(text: str, start: int, end: int, p: float | None) -> dict[str, Any]:
    return {"text": text, "token_start": start, "token_end": end, "p_wrong": p}


class Scorer:
    """A head with the recipe it was trained with (logprobs, step splitting). ``inputs``: the head's
    token inputs, where the worker reduces rows to them (rows ``[rows, 1, D]``; see the module)."""

    def __init__(self, head: UncertaintyHead, name: str, tokenizer: Any, layers: Sequence[int],
                 inputs: TokenInputs | None = None):
        self.head = head
        face: Any = _OneStepAtATime(head) if inputs is None else ReducedHead(head, inputs)
        self._stepwise = cast(UncertaintyHead, face)  # the head's own face, via __getattr__
        self.reduced = inputs is not None
        self.inputs_width = 0 if inputs is None else inputs.width  # D: a reduced row's width
        self.name = name
        self.tokenizer = tokenizer
        self.layers = tuple(layers) if inputs is None else (REDUCED_LAYER,)  # the columns rows carry, in order
        generation = head.require_usage(generation=True).generation
        assert generation is not None  # require_usage(generation=True) refuses a head without one
        self.recipe = GenerationRecipe(**generation)
        if inputs is not None and tuple(layers) != inputs.layers:
            raise ValueError(f"the head's token inputs read layers {list(inputs.layers)}; the engine captures "
                             f"{list(layers)}")
        missing = [k for k in self._feature_recipe.layers if k not in self.layers]
        if missing:
            raise ValueError(f"the head needs layers {missing}, which the engine does not capture "
                             f"(captured: {list(self.layers)}); add them with --layers")

    @property
    def _feature_recipe(self) -> FeatureRecipe:
        """The recipe of the features the scorer builds (a head without one cannot score): the
        head's, or the facade's over reduced rows."""
        recipe = self._stepwise.recipe
        assert recipe is not None
        return recipe

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

    def answer_offsets(self) -> AnswerOffsets:
        """Token offsets for one growing answer, kept between its splits (:meth:`final_spans`)."""
        return AnswerOffsets(self.tokenizer)

    def final_spans(self, token_ids: list[int], offsets: AnswerOffsets) -> list[StepSpan]:
        """Steps of a growing answer that can no longer change: all but the last one (``offsets``:
        the answer's, from :meth:`answer_offsets`, so a split costs only the new tokens' decoding)."""
        return split_steps(token_ids, offsets, mode=self.recipe.split_mode)[:-1] if token_ids else []

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
