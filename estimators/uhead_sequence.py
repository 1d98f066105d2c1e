"""``name: estimators.uhead_sequence`` - sequence-level P(wrong) from a saved head.

cfg: ``head_path`` (dir or ``default``), ``reduce`` (auto | whole | max | mean | last), ``name``,
``allow_other_weights`` (accept a head trained on other weights of the same model shape).
"""

from __future__ import annotations

from typing import Any

from uhead_vllm.polygraph.estimators import UHeadSequence

from ._config import plain


def load_estimator(config: Any) -> UHeadSequence:
    return UHeadSequence(**plain(config))
