"""``builder: estimators.uhead_hidden_states`` - greedy stats + hidden states in one vLLM pass (cfg:
see :func:`uhead_vllm.polygraph.builders.uhead_hidden_states`)."""

from __future__ import annotations

from typing import Any

from uhead_vllm.polygraph import builders


def load_stat_calculator(config: Any, environment: Any):
    return builders.uhead_hidden_states(config, environment)
