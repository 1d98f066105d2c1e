"""A worker extension for benchmarks only: the capturing engine's aux hidden-state outputs (the
graphs carry them, as with capture) without its step listener, so ``bench_gpu --paired --split
--aux-only`` can price the aux outputs apart from the per-step recording hooks.

Name ``AuxOnlyExtension`` as ``worker_extension_cls`` in place of the capture extension (only an
engine-core process may import this module: it patches the extension's adapters there). The engine
records nothing (no generator on it).
"""

from __future__ import annotations

from typing import Any

from experiments.gpu.listener_patch import wrap_listener
from uhead_vllm.capture.extension import UheadCaptureExtension


def _no_listener(listener: Any) -> None:
    """Attach nothing: the aux outputs stay enabled, no step is recorded."""
    return None


wrap_listener(_no_listener)


class AuxOnlyExtension(UheadCaptureExtension):
    """The capture extension, installed by the patched after-load hook above."""
