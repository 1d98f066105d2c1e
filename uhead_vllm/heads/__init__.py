"""Uncertainty heads: train on per-step features, save/load safely, score steps."""

from .attention import AttentionPoolingHead
from .base import HeadConfig, HeadFormatError, HeadMismatchError, UncertaintyHead, identity_from_hf_config
from .io import HEAD_DIR_ENV, default_head_dir, load_head, load_head_for_model
from .linear import LinearProbeHead

__all__ = [
    "AttentionPoolingHead",
    "HEAD_DIR_ENV",
    "HeadConfig",
    "HeadFormatError",
    "HeadMismatchError",
    "LinearProbeHead",
    "UncertaintyHead",
    "default_head_dir",
    "identity_from_hf_config",
    "load_head",
    "load_head_for_model",
]
