"""What every runner adapter hands the recorder: the layout and outputs of one model step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


@dataclass
class StepOutputs:
    """One forward of the model runner, as the recorder needs it.

    ``query_start_loc`` is host memory (reading it never waits for the device); the tensors may be
    padded device buffers (CUDA-graph outputs): only rows ``< query_start_loc[-1]`` are real.
    """

    req_ids: list[str]  # row order of this forward
    query_start_loc: np.ndarray  # [num_reqs + 1] token offsets, host
    positions: torch.Tensor  # [T] (or [3, T] for M-RoPE), device
    input_ids: torch.Tensor  # [T], device
    aux: list[torch.Tensor]  # the aux hidden states, sorted by HF index, each [T, H], device;
    #                          empty when the model was not asked for aux outputs (layer-hook route)


@dataclass
class ScheduledStep:
    """What the scheduler asked of one step: new requests' capture args and tokens per request.

    Each scheduled request's first position this step is its count of tokens already computed
    (:meth:`num_computed`): new requests' are read with them; running requests' stay vLLM's own
    lists, read only when asked (a capture window not yet reached), so a steady decode step costs
    nothing for them. vLLM counts optimistically (scheduled draft tokens count before they are
    verified), so a count is never below the first position this step forwards.
    """

    new_requests: list[tuple[str, dict | None]]  # (req_id, SamplingParams.extra_args)
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: set[str]
    prompt_lens: dict[str, int] = field(default_factory=dict)  # new requests' prompt lengths
    new_computed: dict[str, int] = field(default_factory=dict)  # new requests' tokens computed (cache hits)
    running_ids: list[str] = field(default_factory=list)  # running requests (vLLM's list, not copied)
    running_computed: list[int] = field(default_factory=list)  # their tokens computed, in that order
    resumed: set[str] = field(default_factory=set)  # running requests resumed after a preemption

    def num_computed(self) -> dict[str, int]:
        """Tokens computed before this step, per scheduled request (new and running)."""
        return {**dict(zip(self.running_ids, self.running_computed)), **self.new_computed}


class StepListener(Protocol):
    """The capture side's end of the adapter: called on every real (non-dummy) runner step."""

    def on_schedule(self, step: ScheduledStep) -> None: ...

    def on_forward(self, step: StepOutputs) -> None: ...

    # Optional: ``before_forward(step)`` (``step.aux`` empty) is called right before the model
    # runs, where the runner can tell the batch layout then (V1); steering needs it.


class RunnerAdapter(Protocol):
    """One vLLM model-runner implementation (V1 ``GPUModelRunner`` and its CPU subclass, or Model
    Runner V2). Installs the listener so it runs outside any replayed CUDA graph."""

    name: str

    def enable_aux_outputs(self, runner: Any, layers: tuple[int, ...]) -> None:
        """Make the model and the runner (dummy runs, graph capture) carry ``(hidden, [aux...])``."""

    def attach(self, runner: Any, listener: StepListener) -> None:
        """Call ``listener`` on every real step of ``runner``."""


def read_scheduled_step(scheduler_output: Any) -> ScheduledStep:
    """The fields of vLLM's ``SchedulerOutput`` capture needs (same in both runners; the field
    names are those of vLLM 0.26 and 0.32: ``NewRequestData.num_computed_tokens``,
    ``CachedRequestData.req_ids`` / ``num_computed_tokens`` / ``resumed_req_ids``)."""
    new, prompt_lens, computed = [], {}, {}
    for req in scheduler_output.scheduled_new_reqs:
        sp = req.sampling_params
        new.append((req.req_id, None if sp is None else sp.extra_args))
        computed[req.req_id] = req.num_computed_tokens
        ids = getattr(req, "prompt_token_ids", None)
        if ids is not None:
            prompt_lens[req.req_id] = len(ids)
    running = scheduler_output.scheduled_cached_reqs
    return ScheduledStep(new_requests=new,
                         num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
                         finished_req_ids=set(scheduler_output.finished_req_ids), prompt_lens=prompt_lens,
                         new_computed=computed, running_ids=running.req_ids,
                         running_computed=running.num_computed_tokens,
                         resumed=getattr(running, "resumed_req_ids", None) or set())


def split_model_output(output: Any) -> list[torch.Tensor]:
    """The aux list of a ``(hidden, [aux...])`` model output, or ``[]`` for a plain output."""
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], list):
        return output[1]
    return []


def wrap_method(obj: Any, name: str, make: Any) -> None:
    """Replace bound method ``obj.name`` on this instance only by ``make(original)``."""
    original = getattr(obj, name)
    setattr(obj, name, make(original))
