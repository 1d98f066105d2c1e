"""The value study: on-policy step data, a ranking head, and best-of-n / beam search
over one shared step tree, compared with greedy, logprob scorers and majority vote.

``tree`` (nodes, candidates, batched expansion and scoring), ``resume`` (the tree on disk),
``labels`` (rollouts + checker), ``steps`` (labelled sibling data), ``train`` (ranking head, step
metrics), ``search`` (the strategies), ``stats`` (bootstrap, step metrics). The command: ``experiments/value/run_value_study.py``.
"""
