"""How answers are generated and cut into steps for a head: the generation recipe (prompt style,
sampling, step splitting) and the job's engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from .prompts import PROMPT_STYLES, HasQuestionText, build_chat


@dataclass
class GenerationRecipe:
    """How answers are produced and cut into steps; recorded in dataset manifests and in a head's
    usage (:class:`uhead_vllm.heads.HeadUsage`) so the main job prompts and splits exactly like the
    head's training data."""

    style: str = "steps_plain"
    max_tokens: int = 64
    temperature: float = 0.0
    logprobs: int = 10
    split_mode: Literal["line", "sentence"] = "line"
    seed: int = 0
    samples: int = 1  # answers per question (vLLM n); > 1 needs temperature > 0

    #: Fields that decide what a step's features mean; datasets trained together must agree on
    #: them (temperature, seed, samples and max_tokens only change which answers there are).
    FEATURE_FIELDS = ("style", "logprobs", "split_mode")

    def __post_init__(self) -> None:
        if self.style not in PROMPT_STYLES:
            raise ValueError(f"unknown prompt style {self.style!r}; known: {sorted(PROMPT_STYLES)}")
        if self.logprobs < 1:
            raise ValueError("logprobs must be >= 1: baselines need the sampled token's logprob")
        if self.split_mode not in ("line", "sentence"):
            raise ValueError("split_mode must be 'line' or 'sentence'")
        if self.samples < 1 or (self.samples > 1 and self.temperature <= 0):
            raise ValueError("samples must be >= 1, and > 1 only with temperature > 0 (greedy samples are identical)")

    def chat(self, question: HasQuestionText | str) -> list[dict]:
        return build_chat(question, self.style)

    def sampling_params(self) -> Any:
        from vllm import SamplingParams

        return SamplingParams(n=self.samples, max_tokens=self.max_tokens, temperature=self.temperature,
                              logprobs=self.logprobs, seed=self.seed if self.temperature > 0 else None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_job_generator(model_path: str | Path, layers: Sequence[int], **engine_overrides: Any) -> Any:
    """The engine of the main job and of the study's collection (so a head scores answers captured
    like its training data): :data:`~uhead_vllm.generation.SMALL_CPU_ENGINE` (``engine_overrides``
    replace entries), bf16 rows, a 256 MiB prefix row store, one-step generation (a candidate idle
    for one call is dropped), vLLM logging errors only."""
    from ..generation import SMALL_CPU_ENGINE, build_generator
    from ..runtime import set_env_defaults

    set_env_defaults(quiet=True)
    return build_generator(model_path, layers, capture_dtype="bfloat16",
                           generator_kwargs={"store_max_bytes": 256 << 20, "step_cache_max_idle": 1},
                           **{**SMALL_CPU_ENGINE, **engine_overrides})
