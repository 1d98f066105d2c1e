"""What polygraph_eval's builder modules do: turn a Hydra/OmegaConf node into our estimators and stat
calculators.

lm-polygraph imports the top-level ``estimators`` package's modules by name (``name:
estimators.uhead_sequence`` for an estimator, ``builder: estimators.uhead_features`` for a stat
calculator) and calls their ``load_estimator(config)`` / ``load_stat_calculator(config,
environment)``; those modules only forward here, so all the logic lives in the library.
"""

from __future__ import annotations

from typing import Any

from ..features import FeatureRecipe
from .adapter import upgrade_whitebox
from .calculators import UheadFeaturesCalculator, VllmHiddenStatesCalculator
from .estimators import OutputLength, UHeadClaim, UHeadSequence
from .head_io import check_head_for_model, head_recipe, read_head_config, served_model_identity


def plain(cfg: Any) -> dict[str, Any]:
    """``cfg`` (DictConfig, dict or None) as a resolved plain dict."""
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # no hydra-core (the `polygraph` extra): cfg cannot be a DictConfig
        return dict(cfg)
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def uhead_sequence(config: Any) -> UHeadSequence:
    """cfg: ``head_path`` (dir or ``default``), ``reduce`` (auto | whole | max | mean | last), ``name``,
    ``allow_other_weights`` (accept a head trained on other weights of the same model shape)."""
    return UHeadSequence(**plain(config))


def uhead_claim(config: Any) -> UHeadClaim:
    """cfg: ``head_path`` (dir or ``default``), ``name``, ``allow_other_weights``."""
    return UHeadClaim(**plain(config))


def output_length(config: Any) -> OutputLength:
    """No cfg: the number of generated tokens (a baseline)."""
    if plain(config):
        raise ValueError(f"estimators.output_length takes no cfg, got {plain(config)}")
    return OutputLength()


def uhead_features(config: Any, environment: Any) -> UheadFeaturesCalculator:
    """Answer and per-claim features for a head's recipe.

    cfg: ``head_path`` (the recipe is read from the head, which is also checked against the served
    model here, before any generation) or explicit ``layers`` / ``pooling`` / ``logprob_topk``;
    ``split_mode`` (line | sentence); ``allow_other_weights`` accepts a head trained on other
    weights of the served model's shape (weights fingerprint mismatch).
    """
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


def uhead_hidden_states(config: Any, environment: Any) -> VllmHiddenStatesCalculator:
    """Greedy stats + hidden states in one vLLM pass; upgrades the run's ``WhiteboxModelvLLM`` in
    place to ``UheadWhiteboxModelvLLM`` (polygraph_eval builds the stock class itself).

    cfg: ``adapter`` (``enable_thinking``, ``system_prompt``) and the calculator's
    ``n_alternatives``, ``compute_last_token``, ``strict``, ``store_max_bytes``.
    """
    cfg = plain(config)
    upgrade_whitebox(environment.model, **(cfg.pop("adapter", None) or {}))
    return VllmHiddenStatesCalculator(**cfg)
