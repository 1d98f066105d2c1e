"""UHeadVLLMModel: what thinkbooster's ``VLLMStepGenerator`` expects of lm-polygraph's
``VLLMWithUncertainty``, with an uncertainty head (or a baseline) as the step scorer.

thinkbooster 0.1.1 (``thinkbooster/generators/vllm.py``) uses its ``model`` like this:

- ``model.get_tokenizer()`` once; ``hasattr(model, "estimator")`` decides whether steps are scored;
- ``model.generate(prompts, sampling_params, compute_uncertainty=True)`` → per prompt an object
  with ``.outputs`` (vLLM ``CompletionOutput``: ``text``, ``token_ids``, ``logprobs``,
  ``stop_reason``); with ``compute_uncertainty=False`` it calls ``model.llm.generate`` directly;
- ``model.score(token_ids[:k], logprobs[:k], output=output, claim_range=(0, k))`` per candidate,
  where ``k`` drops the stop string, and stores ``validity_score = 1 / (1 + u)``;
- newer strategies call ``model.reset_hs_step_cache()`` before each multi-step loop.

Generation goes through :class:`~uhead_vllm.generation.VllmHiddenStatesGenerator`, so every
candidate carries the exact hidden states of its own tokens (prefix cache, n>1 and multi-step
prompts included). Each returned ``CompletionOutput`` gets a ``uhead_candidate`` attribute
(:class:`CandidateHandle`) from which ``score`` reads the rows of exactly ``claim_range``.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..features import StepSpan
from .scorers import CandidateStep, StepScorer

HANDLE_ATTR = "uhead_candidate"


@dataclass
class CandidateHandle:
    """What ``score`` needs of one generated sample; only generated-token rows are kept."""

    prompt: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    layers: tuple[int, ...]
    hidden: torch.Tensor | None  # [rows of generated tokens, L, H]
    logprobs: Sequence[dict[int, Any]] | None


@dataclass
class ScoreRecord:
    """One ``score`` call: the span scored, its uncertainty, and (if kept) the rows behind it."""

    prompt: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    claim_range: tuple[int, int]
    span: StepSpan  # claim_range without trailing special tokens (see UHeadVLLMModel)
    uncertainty: float
    rows: torch.Tensor | None = None  # [len(span), L, H]


@dataclass
class ScoredRequestOutput:
    """A vLLM ``RequestOutput`` plus one uncertainty per sample (``None`` for an empty sample)."""

    request_output: Any
    uncertainty_scores: list[float | None]

    def __getattr__(self, name: str) -> Any:
        if name == "request_output":  # not yet set (copy/pickle): avoid recursion
            raise AttributeError(name)
        return getattr(self.request_output, name)


@dataclass
class ModelTimings:
    """Wall time spent generating (incl. capture) and scoring, for experiments."""

    generate_s: float = 0.0
    score_s: float = 0.0
    generate_calls: int = 0
    score_calls: int = 0


class UHeadVLLMModel:
    """Drop-in ``model=`` for thinkbooster's ``VLLMStepGenerator``; steps scored by ``scorer``.

    ``scorer`` maps a candidate step to ``u >= 0`` (thinkbooster's validity is ``1 / (1 + u)``);
    see :mod:`uhead_vllm.thinkbooster.scorers` (head: ``u = p / (1 - p)`` so validity = 1 - P(wrong)).

    Options, and why:

    - ``compute_last_token`` (default: when the scorer reads hidden states): vLLM never forwards
      the last sampled token, but a step that stopped at a stop string or at max_tokens needs that
      token's row to be scored on *all* its tokens; the generator computes it exactly.
    - ``drop_trailing_special`` (default True): a trailing EOS / special token is not part of the
      step's text (it decodes to nothing) and has no row in ordinary generations, which is how
      heads are trained (``features.clip_span``); it is left out of the scored span.
    - ``keep_stop_strings`` (default False): vLLM strips a stop string from ``text``, so with line
      steps (stop at "\\n") thinkbooster would glue the lines of a trajectory together. True sets
      ``include_stop_str_in_output`` so each step keeps its newline, and with it its token.
    - ``record_scores``: keep a :class:`ScoreRecord` (with rows) per ``score`` call, for audits.
    """

    def __init__(
        self,
        generator: Any,
        scorer: StepScorer,
        *,
        compute_last_token: bool | None = None,
        drop_trailing_special: bool = True,
        keep_stop_strings: bool = False,
        record_scores: bool = False,
    ):
        self.generator = generator
        self.llm = generator.llm
        self.tokenizer = generator.tokenizer
        self.estimator = scorer  # thinkbooster checks hasattr(model, "estimator")
        self.layers: tuple[int, ...] = tuple(generator.layers)
        needed = getattr(scorer, "layers", None)
        if scorer.needs_hidden and needed is not None:
            missing = [k for k in needed if k not in self.layers]
            if missing:
                raise ValueError(f"scorer reads layers {missing} that the engine does not capture "
                                 f"(captured: {list(self.layers)}); build the engine with the head's layers")
        self.compute_last_token = scorer.needs_hidden if compute_last_token is None else compute_last_token
        self.drop_trailing_special = drop_trailing_special
        self.keep_stop_strings = keep_stop_strings
        self.record_scores = record_scores
        self.score_records: list[ScoreRecord] = []
        self.timings = ModelTimings()
        self._special_ids = frozenset(int(t) for t in (self.tokenizer.all_special_ids or []))

    # ------------------------------------------------------------------ lm-polygraph surface
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: str | Sequence[Any],
        sampling_params: Any | Sequence[Any] | None = None,
        compute_uncertainty: bool = True,
    ) -> list[ScoredRequestOutput]:
        """Generate with exact hidden states; each output gets a handle for :meth:`score`."""
        start = time.perf_counter()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params(sampling_params)
        # Step scores read the generated tokens' rows only (FeatureRecipe.window): capture just those.
        res = self.generator.generate(list(prompts), params, compute_last_token=self.compute_last_token,
                                      window="generated")
        keep_rows = self.estimator.needs_hidden
        results = []
        for i, ro in enumerate(res.outputs):
            for s, co in enumerate(ro.outputs):
                hs = res.hidden_states[i][s]
                if list(co.token_ids) != hs.output_token_ids:
                    raise RuntimeError(f"prompt {i} sample {s}: hidden states belong to other tokens")
                rows = hs.generated_rows().clone() if keep_rows else None  # its own rows: the call's buffer can go
                setattr(co, HANDLE_ATTR, CandidateHandle(
                    hs.prompt, list(hs.prompt_token_ids), list(hs.output_token_ids), hs.layers, rows,
                    co.logprobs))
            results.append(ScoredRequestOutput(ro, []))
        self.timings.generate_s += time.perf_counter() - start
        self.timings.generate_calls += 1
        if compute_uncertainty:
            for r in results:
                r.uncertainty_scores = [
                    self._uncertainty(getattr(co, HANDLE_ATTR), (0, len(co.token_ids)), record=False)
                    if len(co.token_ids) else None
                    for co in r.outputs
                ]
        return results

    def score(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[dict[int, Any]] | None = None,
        output: Any = None,
        claim_range: tuple[int, int] | None = None,
    ) -> float:
        """Uncertainty ``u`` of generated tokens ``claim_range`` (default: all of ``token_ids``) of ``output``.

        ``token_ids`` must equal ``output.token_ids[claim_range]``; a mismatch, an empty span or an
        output not produced by :meth:`generate` raises ``ValueError`` (thinkbooster then logs it
        and leaves that candidate's validity at ``None``).
        """
        handle = getattr(output, HANDLE_ATTR, None) if output is not None else None
        if handle is None:
            raise ValueError("score() needs output= from UHeadVLLMModel.generate: hidden states are "
                             "attached to that output (token ids alone do not identify a candidate)")
        a, b = (0, len(token_ids)) if claim_range is None else (int(claim_range[0]), int(claim_range[1]))
        if not 0 <= a <= b <= len(handle.output_token_ids):
            raise ValueError(f"claim_range {(a, b)} outside the {len(handle.output_token_ids)} generated tokens")
        if [int(t) for t in token_ids] != handle.output_token_ids[a:b]:
            raise ValueError(f"token_ids do not match output.token_ids[{a}:{b}]")
        return self._uncertainty(handle, (a, b), record=self.record_scores)

    def reset_hs_step_cache(self, reset_prefix_cache: bool = True) -> None:
        """Start a new multi-step loop (forget candidate trajectories; optionally the prefix cache)."""
        self.generator.reset_hs_step_cache(reset_prefix_cache=reset_prefix_cache)

    def __getattr__(self, name: str) -> Any:
        # Like VLLMWithUncertainty: anything else is the vLLM engine's.
        if name.startswith("_") or name in ("llm", "generator", "estimator"):
            raise AttributeError(name)
        return getattr(self.llm, name)

    # ------------------------------------------------------------------ internals
    def _params(self, sampling_params: Any) -> Any:
        if not self.keep_stop_strings or sampling_params is None:
            return sampling_params

        def keep(sp: Any) -> Any:
            sp = copy.deepcopy(sp)
            sp.include_stop_str_in_output = True
            return sp

        if isinstance(sampling_params, (list, tuple)):
            return [keep(sp) for sp in sampling_params]
        return keep(sampling_params)

    def scored_span(self, output_token_ids: Sequence[int], claim_range: tuple[int, int]) -> StepSpan:
        """``claim_range`` without trailing special tokens (unless that would leave it empty)."""
        a, b = claim_range
        if b <= a:
            raise ValueError(f"empty step: claim_range {claim_range}")
        if self.drop_trailing_special:
            while b - a > 1 and int(output_token_ids[b - 1]) in self._special_ids:
                b -= 1
        return StepSpan(a, b)

    def _uncertainty(self, handle: CandidateHandle, claim_range: tuple[int, int], record: bool) -> float:
        start = time.perf_counter()
        span = self.scored_span(handle.output_token_ids, claim_range)
        if self.estimator.needs_hidden:
            have = 0 if handle.hidden is None else handle.hidden.shape[0]
            if span.end > have:
                raise ValueError(f"step {span} needs rows up to generated token {span.end - 1} but only "
                                 f"{have} exist; build UHeadVLLMModel with compute_last_token=True (a candidate "
                                 "that fills max_model_len has no row for its last token)")
        step = CandidateStep(handle.output_token_ids, span, handle.hidden, handle.layers, handle.logprobs)
        u = float(self.estimator.uncertainty(step))
        if not math.isfinite(u) or u < 0:
            raise ValueError(f"scorer {self.estimator.name!r} returned an invalid uncertainty {u!r}")
        self.timings.score_s += time.perf_counter() - start
        self.timings.score_calls += 1
        if record:
            rows = handle.hidden[span.start : span.end].clone() if handle.hidden is not None else None
            self.score_records.append(ScoreRecord(
                handle.prompt, handle.prompt_token_ids, handle.output_token_ids, claim_range, span, u, rows))
        return u
