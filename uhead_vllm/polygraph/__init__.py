"""lm-polygraph integration: fixed vLLM adapter, hidden-state stat calculators, head estimators.

``polygraph_eval`` loads the builder modules in the top-level ``estimators`` package by name; they
forward to :mod:`.builders`. The Hydra configs are in ``configs/polygraph/`` (YAML, plus thin files
polygraph_eval loads by path: the model load script -> :mod:`.loading`, the answer processing ->
:mod:`.processing`); see docs/integrations.md.
"""

from .adapter import (
    LM_POLYGRAPH_SYSTEM_PROMPT,
    LogprobsMissingError,
    UheadWhiteboxModelvLLM,
    dense_vocab_size,
    upgrade_whitebox,
)
from .calculators import UheadFeaturesCalculator, VllmHiddenStatesCalculator
from .estimators import OutputLength, UHeadClaim, UHeadSequence
from .head_io import HeadNotFoundError, default_head_dir, resolve_head_dir
from .loading import DatasetColumnError, check_csv_dataset, load_capture_llm

__all__ = [
    "LM_POLYGRAPH_SYSTEM_PROMPT", "LogprobsMissingError", "UheadWhiteboxModelvLLM", "dense_vocab_size",
    "upgrade_whitebox", "UheadFeaturesCalculator", "VllmHiddenStatesCalculator", "OutputLength",
    "UHeadClaim", "UHeadSequence", "HeadNotFoundError", "default_head_dir", "resolve_head_dir",
    "DatasetColumnError", "check_csv_dataset", "load_capture_llm",
]
