"""Real-data uncertainty study: collect labelled answers with hidden states, train heads,
evaluate them against logprob baselines, and answer questions with per-step uncertainty."""

from .commands import answer, collect, evaluate, register, run_study, train

__all__ = ["answer", "collect", "evaluate", "register", "run_study", "train"]
