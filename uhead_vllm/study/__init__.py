"""The research pipeline: collect labelled answers with hidden states, train heads, evaluate them
against logprob baselines (``uhead-vllm collect / train / evaluate / study``).

The command functions live in :mod:`uhead_vllm.study.commands` (``commands.collect``,
``commands.train``, ``commands.evaluate``); they are not re-exported here, because their names are
those of this package's modules. The main job (``answer``) is the product's:
:func:`uhead_vllm.answer` (:mod:`uhead_vllm.scoring.answer`).
"""

from .commands import StudyPlan, register, run_study

__all__ = ["StudyPlan", "register", "run_study"]
