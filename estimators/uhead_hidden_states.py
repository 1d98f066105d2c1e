"""``builder: estimators.uhead_hidden_states`` - greedy stats + hidden states in one vLLM pass.

Also upgrades the run's ``WhiteboxModelvLLM`` in place to ``UheadWhiteboxModelvLLM`` (polygraph_eval
builds the stock class itself). cfg: ``adapter`` (``enable_thinking``, ``system_prompt``) and the
calculator's ``n_alternatives``, ``compute_last_token``, ``strict``, ``store_max_bytes``.
"""

from __future__ import annotations

from typing import Any

from uhead_vllm.polygraph.adapter import upgrade_whitebox
from uhead_vllm.polygraph.calculators import VllmHiddenStatesCalculator

from ._config import plain


def load_stat_calculator(config: Any, environment: Any) -> VllmHiddenStatesCalculator:
    cfg = plain(config)
    upgrade_whitebox(environment.model, **(cfg.pop("adapter", None) or {}))
    return VllmHiddenStatesCalculator(**cfg)
