"""A worker extension for benchmarks only: the capture extension with a clock around every engine
step, so ``ablate_capture --timing`` can say which part of a step grows when rows are captured.

Per step it keeps three host timestamps in the engine-core process: ``execute_model`` entered (the
listener's ``on_schedule``), the forward launched (the runner returned, before recording) and the
recording done; and whether that step's recording flushed a batch to the host. From consecutive
steps: ``launch`` (schedule to forward launched; it includes the recorder's ``on_schedule``),
``record`` (the recorder's ``on_forward``), ``rest`` (from
recording done to the next step: sampling, the scheduler, outputs; the engine's own work, where a
thread beside it or a copy in the way would show). Untagged steps go through the same listener.

It also times the garbage collector in that process (every thread's collections, by generation),
so a run's extra allocations show as collections rather than as slower vLLM code.

Name ``StepTimingExtension`` as ``worker_extension_cls`` in place of the capture extension (only
an engine-core process may import this module: it patches the extension's adapters there,
``listener_patch.py``).
"""

from __future__ import annotations

import gc
import json
import time
from typing import Any

from experiments.gpu.listener_patch import wrap_listener
from uhead_vllm.capture.extension import UheadCaptureExtension

_STEPS: list[tuple[float, float, float, bool]] = []  # (entered, launched, recorded, flushed) per step
_GC = {"collections": [0, 0, 0], "seconds": [0.0, 0.0, 0.0]}  # per generation, since the last take
_gc_started = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        g = info["generation"]
        _GC["collections"][g] += 1
        _GC["seconds"][g] += time.perf_counter() - _gc_started[0]


gc.callbacks.append(_on_gc)


class _TimedListener:
    """Forwards to the recorder and keeps each step's timestamps."""

    def __init__(self, recorder: Any):
        self._recorder = recorder
        self._entered = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._recorder, name)

    def on_schedule(self, step: Any) -> None:
        self._entered = time.perf_counter()
        self._recorder.on_schedule(step)

    def on_forward(self, step: Any) -> None:
        launched = time.perf_counter()
        placed = self._recorder.rows_placed
        self._recorder.on_forward(step)
        _STEPS.append((self._entered, launched, time.perf_counter(), self._recorder.rows_placed != placed))


wrap_listener(_TimedListener)


class StepTimingExtension(UheadCaptureExtension):
    """The capture extension, installed by the patched after-load hook above."""

    def timing_take(self) -> str:
        """The steps timed and the collections since the last take, as JSON (no pickled objects
        cross processes): ``{"steps": [...], "gc": {"collections": [g0, g1, g2], "seconds": [...]}}``."""
        taken = {"steps": list(_STEPS), "gc": {k: list(v) for k, v in _GC.items()}}
        _STEPS.clear()
        _GC["collections"], _GC["seconds"] = [0, 0, 0], [0.0, 0.0, 0.0]
        return json.dumps(taken)

