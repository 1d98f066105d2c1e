"""Every touch of vLLM internals lives in this package: one module per model runner, one for the
model and process, one for the checked versions, one per set of CPU repairs (speculative
sampling; DeepSeek-V4), one for the engine side.

A new vLLM version is a new row in ``versions.SUPPORTED_VLLM`` plus, where its internals moved, a
new runner module registered in ``RUNNERS``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from . import cpu_repairs, v1_runner, v2_runner
from .base import ScheduledStep, StepListener, StepOutputs
from .versions import SUPPORTED_VLLM, UnsupportedVllmError, check_vllm_version, supported_text

#: Runner adapters, most specific first (Model Runner V2 does not subclass V1).
RUNNERS: tuple[ModuleType, ...] = (v2_runner, v1_runner)


def install_load_hooks(after_load: Callable[[Any], None]) -> None:
    """Call ``after_load(runner)`` in every runner kind, after load and before compile/graphs;
    on CPU, repair seeded sampling of split prompts first (any engine of ours, captured or not)."""
    def load_hook(runner: Any) -> None:
        cpu_repairs.repair_cpu_seeded_prefill()
        after_load(runner)

    for runner in RUNNERS:
        runner.install_load_hook(load_hook)


def worker_runner(worker: Any) -> Any:
    """The model runner of a vLLM worker (what the worker extension's RPCs read)."""
    return worker.model_runner


def runner_adapter(runner: Any) -> ModuleType:
    """The adapter module for this runner instance; refuses runners nobody checked."""
    for adapter in RUNNERS:
        cls = adapter.runner_class()
        if cls is not None and isinstance(runner, cls):
            missing = adapter.missing_internals(runner)
            if missing:
                raise UnsupportedVllmError(
                    f"{type(runner).__name__} lacks {missing}, which uhead_vllm's {adapter.NAME} "
                    f"runner adapter needs; checked versions: {supported_text()}"
                )
            return adapter
    raise UnsupportedVllmError(
        f"no uhead_vllm adapter for the model runner {type(runner).__module__}."
        f"{type(runner).__name__}; checked versions: {supported_text()}"
    )


__all__ = ["RUNNERS", "SUPPORTED_VLLM", "ScheduledStep", "StepListener", "StepOutputs",
           "UnsupportedVllmError", "check_vllm_version", "install_load_hooks", "runner_adapter",
           "supported_text", "worker_runner"]
