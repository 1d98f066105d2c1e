"""Uncertainty heads: train on per-step features, save/load safely, score steps."""

from .attention import AttentionPoolingHead
from .base import HeadConfig, HeadMismatchError, UncertaintyHead, identity_from_hf_config
from .io import load_head
from .linear import LinearProbeHead

__all__ = [
    "AttentionPoolingHead",
    "HeadConfig",
    "HeadMismatchError",
    "LinearProbeHead",
    "UncertaintyHead",
    "identity_from_hf_config",
    "load_head",
]
