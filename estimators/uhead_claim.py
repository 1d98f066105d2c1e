"""``name: estimators.uhead_claim`` - claim-level (per step) P(wrong) from a saved head (cfg: see
:func:`uhead_vllm.polygraph.builders.uhead_claim`)."""

from __future__ import annotations

from typing import Any

from uhead_vllm.polygraph import builders


def load_estimator(config: Any):
    return builders.uhead_claim(config)
