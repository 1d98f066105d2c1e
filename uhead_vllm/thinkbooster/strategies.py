"""thinkbooster objects for line-by-line reasoning, built around a :class:`UHeadVLLMModel`.

Nothing here changes thinkbooster: these are its own classes with arguments chosen for short
"one calculation per line" answers (a step ends at a newline, as the heads' step labels do).
"""

from __future__ import annotations

from typing import Any, Sequence

from .model import UHeadVLLMModel

STRATEGY_KINDS = ("online_best_of_n", "beam_search")


def line_detector(min_step_tokens: int = 2, max_step_tokens: int = 64, markers: Sequence[str] = ("\n",)) -> Any:
    """thinkbooster's marker detector reduced to ``markers`` as the only step boundaries.

    All word-marker families are off; thinkbooster always adds its answer tokens ("</think>",
    "<Answer>:") as stop strings, harmless for models that never write them.
    """
    from thinkbooster.step_boundary_detectors.thinking import ThinkingMarkerDetector

    flags = ("use_sequence", "use_conclusion", "use_thinking", "use_verification", "use_structure",
             "use_reasoning", "use_sentence_start", "use_correction")
    return ThinkingMarkerDetector(**{f: False for f in flags}, custom_markers=list(markers),
                                  min_step_tokens=min_step_tokens, max_step_tokens=max_step_tokens)


def make_step_generator(
    model: UHeadVLLMModel,
    *,
    temperature: float = 0.7,
    top_p: float = 1.0,
    top_k: int = -1,
    min_step_tokens: int = 2,
    max_step_tokens: int = 64,
    max_new_tokens: int = 64,
    max_context_budget: int = 1024,
    markers: Sequence[str] = ("\n",),
    stop_token_ids: Sequence[int] | None = None,
    seed: int | None = 0,
) -> Any:
    """thinkbooster's ``VLLMStepGenerator`` in non-thinking mode over ``model``.

    Steps end at the ``markers`` stop strings or at ``stop_token_ids`` (both thinkbooster options).
    """
    from thinkbooster.generators.vllm import VLLMStepGenerator

    return VLLMStepGenerator(
        model=model,
        thinking_mode=False,
        detector=line_detector(min_step_tokens, max_step_tokens, markers),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_context_budget=max_context_budget,
        stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
        seed=seed,
    )


def make_strategy(
    kind: str,
    step_generator: Any,
    *,
    candidates_per_step: int = 4,
    max_steps: int = 6,
    beam_size: int = 2,
    candidates_per_beam: int = 2,
    aggregation: str = "min",
    prompt_buffer: int = 500,
) -> Any:
    """thinkbooster strategy scored by ``StepScorerUncertainty`` (reads each candidate's validity)."""
    from thinkbooster.scorers import StepScorerUncertainty
    from thinkbooster.strategies import StrategyBeamSearch, StrategyOnlineBestOfN

    if kind == "online_best_of_n":
        return StrategyOnlineBestOfN(scorer=StepScorerUncertainty(), candidates_per_step=candidates_per_step,
                                     max_steps=max_steps, step_generator=step_generator,
                                     prompt_buffer=prompt_buffer)
    if kind == "beam_search":
        return StrategyBeamSearch(step_generator=step_generator, scorer=StepScorerUncertainty(),
                                  beam_size=beam_size, candidates_per_beam=candidates_per_beam,
                                  max_steps=max_steps, aggregation=aggregation, prompt_buffer=prompt_buffer)
    raise ValueError(f"unknown strategy {kind!r}; known: {STRATEGY_KINDS}")
