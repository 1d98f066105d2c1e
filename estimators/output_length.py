"""``name: estimators.output_length`` - number of generated tokens (a baseline)."""

from __future__ import annotations

from typing import Any

from uhead_vllm.polygraph import builders


def load_estimator(config: Any):
    return builders.output_length(config)
