"""A worker extension for benchmarks only: the capturing engine's aux hidden-state outputs (the
graphs carry them, as with capture) without its step listener, so ``bench_gpu --paired --split
--aux-only`` can price the aux outputs apart from the per-step recording hooks.

Name ``AuxOnlyExtension`` as ``worker_extension_cls`` in place of the capture extension (only an
engine-core process may import this module: it patches the extension's adapters there). The engine
records nothing (no generator on it).
"""

from __future__ import annotations

from typing import Any

from uhead_vllm import adapters
from uhead_vllm.capture import extension
from uhead_vllm.capture.extension import UheadCaptureExtension

_runner_adapter = adapters.runner_adapter


class _WithoutListener:
    """A runner adapter that enables the aux outputs but attaches nothing."""

    def __init__(self, adapter: Any):
        self._adapter = adapter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)

    def attach(self, runner: Any, listener: Any) -> None:
        pass


def _adapter_without_listener(runner: Any) -> Any:
    return _WithoutListener(_runner_adapter(runner))


extension.adapters = type(adapters)("uhead_adapters_without_listener")  # this module's view only
extension.adapters.__dict__.update({k: v for k, v in vars(adapters).items() if not k.startswith("__")})
extension.adapters.runner_adapter = _adapter_without_listener


class AuxOnlyExtension(UheadCaptureExtension):
    """The capture extension, installed by the patched after-load hook above."""
