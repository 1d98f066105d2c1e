"""``builder: estimators.uhead_features`` - answer and per-claim features for a head's recipe.

cfg: ``head_path`` (the recipe is read from the head, which is also checked against the served
model here, before any generation) or explicit ``layers`` / ``pooling`` / ``logprob_topk``;
``split_mode`` (line | sentence); ``allow_other_weights`` accepts a head trained on other weights
of the served model's shape (weights fingerprint mismatch).
"""

from __future__ import annotations

from typing import Any

from uhead_vllm.features import FeatureRecipe
from uhead_vllm.polygraph.calculators import UheadFeaturesCalculator
from uhead_vllm.polygraph.head_io import check_head_for_model, head_recipe, read_head_config, served_model_identity

from ._config import plain


def load_stat_calculator(config: Any, environment: Any) -> UheadFeaturesCalculator:
    cfg = plain(config)
    split_mode = cfg.pop("split_mode", "line")
    head_path = cfg.pop("head_path", None)
    allow_other_weights = bool(cfg.pop("allow_other_weights", False))
    if head_path is not None:
        if cfg:
            raise ValueError(f"give head_path or an explicit recipe, not both (got {sorted(cfg)})")
        head_cfg = read_head_config(head_path)
        check_head_for_model(head_cfg, served_model_identity(environment.model), str(head_path), allow_other_weights)
        recipe = head_recipe(head_cfg, str(head_path))
    else:
        recipe = FeatureRecipe(**cfg)
    return UheadFeaturesCalculator(recipe, split_mode=split_mode)
