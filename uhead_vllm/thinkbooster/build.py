"""Assemble a capturing engine, a head and a :class:`UHeadVLLMModel` from paths and names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..heads import UncertaintyHead
from ..heads import load_head_for_model as load_step_head
from ..models import resolve_model
from .model import UHeadVLLMModel
from .scorers import SCORERS, HeadScorer, StepScorer


def make_scorer(name: str, head: UncertaintyHead | None = None, seed: int = 0) -> StepScorer:
    """Scorer by name: ``head``, ``mean_token_entropy`` (alias ``entropy``), ``mean_nll``, ``random``."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known: {sorted(SCORERS)}")
    if name == "head":
        if head is None:
            raise ValueError("scorer 'head' needs a head")
        return HeadScorer(head)
    if name == "random":
        return SCORERS[name](seed=seed)
    return SCORERS[name]()


def build_uhead_model(
    model: str | Path | None = "default",
    head_dir: str | Path | None = None,
    scorer: str = "head",
    *,
    layers: list[int] | None = None,
    llm_kwargs: dict[str, Any] | None = None,
    generator_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    allow_other_weights: bool = False,
    **model_kwargs: Any,
) -> UHeadVLLMModel:
    """Engine capturing the head's layers (or ``layers``) + generator + model with ``scorer``.

    ``model`` is a local HF folder or "default" (the embedded SmolLM2-135M-Instruct).
    """
    from ..generation import build_generator

    path = resolve_model(model)
    head = load_step_head(head_dir, path, allow_other_weights) if (scorer == "head" or layers is None) else None
    if layers is not None:
        capture = list(layers)
    elif head is not None and head.recipe is not None:
        capture = list(head.recipe.layers)
    else:
        raise ValueError("the head records no feature recipe: pass layers=")
    gen = build_generator(str(path), capture, generator_kwargs=generator_kwargs, **(llm_kwargs or {}))
    return UHeadVLLMModel(gen, make_scorer(scorer, head, seed), **model_kwargs)
