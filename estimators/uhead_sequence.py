"""``name: estimators.uhead_sequence`` - sequence-level P(wrong) from a saved head (cfg: see
:func:`uhead_vllm.polygraph.builders.uhead_sequence`)."""

from __future__ import annotations

from typing import Any

from uhead_vllm.polygraph import builders


def load_estimator(config: Any):
    return builders.uhead_sequence(config)
