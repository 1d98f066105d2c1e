"""``name: estimators.uhead_claim`` - claim-level (per step) P(wrong) from a saved head.

cfg: ``head_path`` (dir or ``default``), ``name``, ``allow_other_weights`` (accept a head trained on
other weights of the same model shape).
"""

from __future__ import annotations

from typing import Any

from uhead_vllm.polygraph.estimators import UHeadClaim

from ._config import plain


def load_estimator(config: Any) -> UHeadClaim:
    return UHeadClaim(**plain(config))
