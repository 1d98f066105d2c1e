"""Features for training a head through the same calculators polygraph_eval runs.

Training on what the estimators will see at evaluation time (same prompts, same greedy decoding,
same spans, same recipe) rules out a whole class of train/test mismatches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..features import FeatureRecipe
from .adapter import UheadWhiteboxModelvLLM
from .calculators import UheadFeaturesCalculator, VllmHiddenStatesCalculator


@dataclass
class CollectedFeatures:
    """Per input text: the greedy answer, its whole-answer features, its claims and their features."""

    texts: list[str] = field(default_factory=list)
    sequence_features: list[torch.Tensor] = field(default_factory=list)
    claims: list[list[Any]] = field(default_factory=list)
    claim_features: list[list[torch.Tensor | None]] = field(default_factory=list)


def collect_features(
    adapter: UheadWhiteboxModelvLLM,
    texts: Sequence[str],
    recipe: FeatureRecipe,
    max_new_tokens: int,
    batch_size: int = 16,
    split_mode: str = "line",
) -> CollectedFeatures:
    """Run the hidden-states and features calculators over ``texts`` in batches."""
    hidden_calc = VllmHiddenStatesCalculator()
    feat_calc = UheadFeaturesCalculator(recipe, split_mode=split_mode)
    out = CollectedFeatures()
    for lo in range(0, len(texts), batch_size):
        batch = list(texts[lo : lo + batch_size])
        stats = hidden_calc({}, batch, adapter, max_new_tokens)
        stats.update(feat_calc(stats, batch, adapter, max_new_tokens))
        out.texts += stats["greedy_texts"]
        out.sequence_features += stats["uhead_sequence_features"]
        out.claims += stats["claims"]
        out.claim_features += stats["uhead_claim_features"]
    return out
