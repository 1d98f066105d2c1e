"""``builder: estimators.uhead_features`` - answer and per-claim features for a head's recipe (cfg:
see :func:`uhead_vllm.polygraph.builders.uhead_features`)."""

from __future__ import annotations

from typing import Any

from uhead_vllm.polygraph import builders


def load_stat_calculator(config: Any, environment: Any):
    return builders.uhead_features(config, environment)
