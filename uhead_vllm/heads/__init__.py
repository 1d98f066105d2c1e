"""Uncertainty heads: train on per-step features, save/load safely, score steps; the one registry
of head classes (:func:`head_class`) and how each head is applied (:class:`HeadUsage`, saved with it)."""

from .attention import AttentionPoolingHead
from .base import (
    HeadConfig,
    HeadFormatError,
    HeadMismatchError,
    HeadUsage,
    UncertaintyHead,
    head_class,
    head_names,
    identity_from_hf_config,
)
from .io import HEAD_DIR_ENV, default_head_dir, load_head, load_head_for_model, ranking_head_dir
from .linear import LinearProbeHead
from .ranking import RankingProbeHead

__all__ = [
    "AttentionPoolingHead",
    "HEAD_DIR_ENV",
    "HeadConfig",
    "HeadFormatError",
    "HeadMismatchError",
    "HeadUsage",
    "LinearProbeHead",
    "RankingProbeHead",
    "UncertaintyHead",
    "default_head_dir",
    "head_class",
    "head_names",
    "identity_from_hf_config",
    "load_head",
    "load_head_for_model",
    "ranking_head_dir",
]
