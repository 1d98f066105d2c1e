"""Stat calculators: one vLLM pass per batch gives greedy stats and exact hidden states; features
for the answer and for each claim (step) are built from them.

Stat names (what estimators may depend on):

- ``VllmHiddenStatesCalculator`` -> lm-polygraph's greedy stats (``greedy_texts``,
  ``greedy_tokens``, ``greedy_log_likelihoods``, ``greedy_log_probs``, ...) plus
  ``uhead_hidden_states`` (one ``SampleHiddenStates`` per input), ``uhead_topk_logprobs``
  (``[T_gen, k]`` best-first per input) and ``uhead_model_identity``.
- ``UheadFeaturesCalculator`` -> ``claims`` (lm-polygraph ``Claim`` per step, so its claim-level
  estimators work too), ``uhead_claim_features`` (``[t, F]`` per claim),
  ``uhead_sequence_features`` (``[t, F]`` of the whole answer) and ``uhead_feature_recipe``.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np
import torch
from lm_polygraph.stat_calculators.extract_claims import Claim
from lm_polygraph.stat_calculators.stat_calculator import StatCalculator

from ..features import FeatureRecipe, StepSpan, split_steps, step_token_features
from ..generation import SampleHiddenStates, VllmHiddenStatesGenerator
from .adapter import UheadWhiteboxModelvLLM
from .greedy import GREEDY_STATS, greedy_stats, topk_logprobs
from .head_io import served_model_identity

HIDDEN_STATS: tuple[str, ...] = (*GREEDY_STATS, "uhead_hidden_states", "uhead_topk_logprobs", "uhead_model_identity")
FEATURE_STATS: tuple[str, ...] = ("claims", "uhead_claim_features", "uhead_sequence_features", "uhead_feature_recipe")
FEATURE_DEPENDENCIES: tuple[str, ...] = ("uhead_hidden_states", "uhead_topk_logprobs")


def _adapter(model: Any) -> UheadWhiteboxModelvLLM:
    if not isinstance(model, UheadWhiteboxModelvLLM):
        raise TypeError(
            f"uhead stat calculators need UheadWhiteboxModelvLLM, got {type(model).__name__}; build it "
            "with the estimators.uhead_hidden_states builder (polygraph_eval) or construct it directly"
        )
    return model


class VllmHiddenStatesCalculator(StatCalculator):
    """Greedy generation of a batch with hidden-state capture (``VllmHiddenStatesGenerator``).

    Replaces lm-polygraph's ``GreedyProbsCalculator`` for vLLM: exact lengths, dense log-prob rows
    of the full vocabulary width, greedy decoding, no attentions or HF hidden states requested.
    ``compute_last_token`` also forwards the last sampled token so every generated token has a row.
    ``window``: the rows captured (see ``VllmHiddenStatesGenerator``); the default ``"generated"``
    is what the features calculator reads (a head's recipe reads only generated rows), ``"all"``
    adds the prompt's rows for estimators of one's own.
    """

    @staticmethod
    def meta_info() -> tuple[list[str], list[str]]:
        return list(HIDDEN_STATS), []

    def __init__(
        self,
        n_alternatives: int = 10,
        compute_last_token: bool = True,
        strict: bool = False,
        store_max_bytes: int = 4 << 30,
        window: str | int = "generated",
    ):
        super().__init__()
        self.window = window
        self.n_alternatives = n_alternatives
        self.compute_last_token = compute_last_token
        self.strict = strict
        self.store_max_bytes = store_max_bytes
        self._generator: VllmHiddenStatesGenerator | None = None
        self._identity: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return "VllmHiddenStatesCalculator"

    def generator(self, adapter: UheadWhiteboxModelvLLM) -> VllmHiddenStatesGenerator:
        """The generator over ``adapter``'s engine (made once; it keeps the prefix row store)."""
        if self._generator is None or self._generator.llm is not adapter.model:
            self._generator = VllmHiddenStatesGenerator(
                adapter, store_max_bytes=self.store_max_bytes, strict=self.strict,
                enable_thinking=adapter.enable_thinking,
            )
            self._identity = served_model_identity(adapter)
        return self._generator

    def __call__(
        self,
        dependencies: dict[str, Any],
        texts: list[str],
        model: Any,
        max_new_tokens: int = 100,
        **kwargs: Any,
    ) -> dict[str, Any]:
        adapter = _adapter(model)
        gen = self.generator(adapter)
        sp = adapter.sampling_params_for(n=1, max_new_tokens=max_new_tokens, do_sample=False)
        res = gen.generate(adapter.prompt_inputs(texts), sp, compute_last_token=self.compute_last_token,
                           window=self.window)
        stats: dict[str, Any] = greedy_stats(res.outputs, adapter.vocab_size, self.n_alternatives)
        k = int(sp.logprobs or 0)
        stats["uhead_hidden_states"] = [res.hidden_states[i][0] for i in range(len(texts))]
        stats["uhead_topk_logprobs"] = [topk_logprobs(ro.outputs[0], k) if k else None for ro in res.outputs]
        stats["uhead_model_identity"] = dict(self._identity or {})
        return stats


def answer_end(token_ids: Sequence[int], special_ids: set[int]) -> int:
    """Number of generated tokens before trailing special tokens (EOS); all of them if that is 0."""
    n = len(token_ids)
    while n > 0 and int(token_ids[n - 1]) in special_ids:
        n -= 1
    return n if n > 0 else len(token_ids)


class UheadFeaturesCalculator(StatCalculator):
    """Per-answer and per-claim feature matrices for a head's :class:`FeatureRecipe`.

    Claims are the answer's steps (``split_steps``, by line or sentence), trailing special tokens
    (EOS) excluded; the answer feature covers the same tokens. Features of a span are the rows at
    its own tokens (see ``uhead_vllm.features``). A claim whose rows were not computed (its only
    token is the last sampled one and ``compute_last_token`` was off) gets ``None``, never zeros.
    """

    @staticmethod
    def meta_info() -> tuple[list[str], list[str]]:
        return list(FEATURE_STATS), list(FEATURE_DEPENDENCIES)

    def __init__(self, recipe: FeatureRecipe, split_mode: str = "line"):
        super().__init__()
        if split_mode not in ("line", "sentence"):
            raise ValueError(f"split_mode must be 'line' or 'sentence', got {split_mode!r}")
        self.recipe = recipe
        self.split_mode: Literal["line", "sentence"] = "sentence" if split_mode == "sentence" else "line"

    def __repr__(self) -> str:
        return "UheadFeaturesCalculator"

    def _features(self, hs: SampleHiddenStates, span: StepSpan, topk: np.ndarray | None) -> torch.Tensor | None:
        rows = hs.generated_rows()  # any capture window
        end = min(span.end, rows.shape[0])
        if end <= span.start:
            return None
        lp = torch.from_numpy(topk) if topk is not None else None
        return step_token_features(rows, 0, StepSpan(span.start, end), self.recipe, lp, hs.layers)

    def __call__(
        self,
        dependencies: dict[str, Any],
        texts: list[str] | None = None,
        model: Any = None,
        max_new_tokens: int = 100,
        **kwargs: Any,
    ) -> dict[str, Any]:
        tokenizer = model.tokenizer
        special = set(int(i) for i in tokenizer.all_special_ids)
        if self.recipe.logprob_topk and any(t is None for t in dependencies["uhead_topk_logprobs"]):
            raise ValueError(f"the head's recipe needs logprob_topk={self.recipe.logprob_topk}; set model.logprobs >= it")
        claims, claim_feats, seq_feats = [], [], []
        for hs, topk in zip(dependencies["uhead_hidden_states"], dependencies["uhead_topk_logprobs"]):
            ids = hs.output_token_ids
            n = answer_end(ids, special)
            sample_claims, sample_feats = [], []
            for span in split_steps(ids[:n], tokenizer, mode=self.split_mode) if n else []:
                text = tokenizer.decode(ids[span.start : span.end], skip_special_tokens=True).strip()
                sample_claims.append(Claim(claim_text=text, sentence=text, aligned_token_ids=list(range(span.start, span.end))))
                sample_feats.append(self._features(hs, span, topk))
            seq = self._features(hs, StepSpan(0, n), topk) if n else None
            if seq is None:
                raise ValueError(
                    f"no hidden-state rows for the answer {hs.text!r} of prompt {hs.prompt_index}; "
                    "enable compute_last_token in the uhead hidden-states calculator"
                )
            claims.append(sample_claims)
            claim_feats.append(sample_feats)
            seq_feats.append(seq)
        return {
            "claims": claims,
            "uhead_claim_features": claim_feats,
            "uhead_sequence_features": seq_feats,
            "uhead_feature_recipe": self.recipe.to_dict(),
        }
