"""Step labels for on-policy candidates: Monte-Carlo rollouts plus the arithmetic checker.

The rule (documented in docs/value_study.md, tested in tests/test_value_study.py):

- a candidate that ends the answer (end-of-sequence) gets value 1 if the whole answer is graded
  right by the task's checker, else 0;
- a candidate whose line holds an arithmetic equation that ``tasks.check_step_line`` finds wrong
  gets value 0 (a wrong calculation is a wrong step even when a later step repairs it);
- any other candidate (a right equation, prose, a restated question) gets the share of ``k``
  rollouts from ``prefix + candidate``, sampled at the search temperature, whose answer is right:
  the usual process-reward estimate of "does this step still lead to the answer".

A step is *wrong* (the positive class of the step metrics) when its value is 0.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ...tasks import Question, check_step_line, grade
from .tree import Candidate, Expander, Node, stable_seed

Grader = Callable[[Question, str], bool]


def default_grader(question: Question, text: str) -> bool:
    return grade(question, text)[0]


def needs_rollouts(cand: Candidate) -> bool:
    return not cand.finished and check_step_line(cand.text) is not False


def label_candidates(
    expander: Expander,
    items: Sequence[tuple[Node, Sequence[Candidate]]],
    *,
    k: int,
    max_tokens: int,
    grader: Grader = default_grader,
) -> int:
    """Set ``value`` on every unlabelled candidate of ``items`` (one batched rollout call).

    Returns the number of rollout tokens generated.
    """
    from vllm import SamplingParams

    prompts, params, owners = [], [], []
    for node, cands in items:
        q = expander.questions[node.q]
        for i, cand in enumerate(cands):
            if cand.value is not None:
                continue
            if cand.finished:
                cand.value = float(grader(q, node.prefix + cand.text))
            elif check_step_line(cand.text) is False:
                cand.value = 0.0
            else:
                prompts.append(expander.prompt_ids(node, cand.text))
                params.append(SamplingParams(n=k, temperature=expander.temperature, top_p=1.0, max_tokens=max_tokens,
                                             seed=stable_seed("rollout", expander.seed, node.q, node.prefix, i)))
                owners.append((q, node.prefix + cand.text, cand))
    if not prompts:
        return 0
    outs = _plain_generate(expander.gen.llm, prompts, params)
    tokens = 0
    for (q, text, cand), ro in zip(owners, outs):
        right = [grader(q, text + co.text) for co in ro.outputs]
        cand.rollout_tokens = sum(len(co.token_ids) for co in ro.outputs)
        tokens += cand.rollout_tokens
        cand.value = sum(right) / len(right)
    return tokens


def _plain_generate(llm: Any, prompts: list, params: list) -> list:
    """Rollouts need no hidden states: untagged requests are not recorded by the capture."""
    return llm.generate(prompts, params, use_tqdm=False)
