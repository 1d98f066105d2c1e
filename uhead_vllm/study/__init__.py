"""Real-data uncertainty study: collect labelled answers with hidden states, train heads,
evaluate them against logprob baselines, and answer questions with per-step uncertainty."""

# The submodules ``answer``, ``collect``, ``evaluate`` and ``train`` share their names with the
# functions re-exported below. Python binds a submodule to its package's attribute when it is
# first imported, so a lazy ``from .answer import ...`` would replace the function ``answer`` with
# the module. Importing them here first, then binding the functions, keeps the functions.
from . import answer as _answer_module  # noqa: F401
from . import collect as _collect_module  # noqa: F401
from . import evaluate as _evaluate_module  # noqa: F401
from . import train as _train_module  # noqa: F401
from .commands import answer, collect, evaluate, register, run_study, train

__all__ = ["answer", "collect", "evaluate", "register", "run_study", "train"]
