"""``name: estimators.output_length`` - number of generated tokens (a baseline)."""

from __future__ import annotations

from typing import Any

from uhead_vllm.polygraph.estimators import OutputLength

from ._config import plain


def load_estimator(config: Any) -> OutputLength:
    if plain(config):
        raise ValueError(f"estimators.output_length takes no cfg, got {plain(config)}")
    return OutputLength()
