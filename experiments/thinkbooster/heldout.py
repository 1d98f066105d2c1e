"""Questions the head never saw, prompted the way the head's training answers were prompted."""

from __future__ import annotations

import logging
from typing import Any, Callable

from uhead_vllm import tasks

log = logging.getLogger(__name__)


def head_study(head: Any) -> dict:
    """What ``uhead-vllm train`` records about a head's training data (empty for heads trained otherwise)."""
    return dict(getattr(head, "training_summary_", {}).get("study") or {})


def chat_builder(head: Any, style: str) -> tuple[Callable[[tasks.Question], list[dict]], str]:
    """Chat builder for ``style``; ``auto`` = the prompt style the head was trained on.

    Hidden states depend on the prompt, so answers scored by a head should be prompted like its
    training answers were.
    """
    if style == "auto":
        usage = getattr(head, "usage", None)
        style = ((usage.generation if usage is not None else None) or {}).get("style")
        if style is None:
            raise ValueError("prompt_style=auto but the head records no training prompt style; set prompt_style")
    if style in ("steps", "direct"):
        return (lambda q: tasks.build_chat(q, style)), style
    from uhead_vllm.scoring.recipe import GenerationRecipe

    recipe = GenerationRecipe(style=style)  # validates the style name
    return recipe.chat, style


def training_questions(head: Any) -> tuple[set[str], list[str]]:
    """Texts of the questions in the head's training datasets (as recorded task plans)."""
    specs = [spec for ds in head_study(head).get("datasets", []) for spec in ds.get("tasks", [])]
    if not specs:
        return set(), []
    from uhead_vllm.study.collect import TaskPlan, select_questions

    texts: set[str] = set()
    for spec in specs:
        plan = TaskPlan.parse(spec) if isinstance(spec, str) else TaskPlan(spec["task"], spec["n"], spec["seed"])
        texts |= {q.question for q in select_questions(plan)}
    return texts, [str(s) for s in specs]


def heldout_questions(task: str, n: int, seed: int, head: Any) -> tuple[list[tasks.Question], dict]:
    """First ``n`` distinct questions of ``task``/``seed`` that are not in the head's training data."""
    exclude, specs = training_questions(head)
    if not specs:
        log.warning("the head records no training datasets: held-out status cannot be checked")
    chosen, seen, pool = [], set(exclude), max(2 * n, 1)
    while len(chosen) < n:
        chosen, seen = [], set(exclude)
        for q in tasks.load_questions(task, pool, seed):
            if q.question not in seen:
                seen.add(q.question)
                chosen.append(q)
                if len(chosen) == n:
                    break
        if len(chosen) < n and pool >= 64 * n:
            raise ValueError(f"only {len(chosen)} distinct unseen {task} questions for seed {seed}")
        pool *= 2
    info = {"excluded_training_questions": len(exclude), "training_task_plans": specs,
            "checked": bool(specs)}
    return chosen, info
