"""For benchmark-only worker extensions: the capture extension's runner adapters with the step
listener changed, in this process's view of the extension only (``aux_only.py``, ``step_timing.py``).

Only an engine-core process may import a module that calls :func:`wrap_listener`: the capture
extension there then attaches ``wrap(listener)`` instead of its recorder, or nothing where ``wrap``
returns None (the aux outputs stay enabled either way).
"""

from __future__ import annotations

from typing import Any, Callable

from uhead_vllm import adapters
from uhead_vllm.capture import extension


class _Wrapped:
    """A runner adapter whose ``attach`` hands the runner ``wrap(listener)`` (nothing for None)."""

    def __init__(self, adapter: Any, wrap: Callable[[Any], Any]):
        self._adapter, self._wrap = adapter, wrap

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)

    def attach(self, runner: Any, listener: Any) -> None:
        wrapped = self._wrap(listener)
        if wrapped is not None:
            self._adapter.attach(runner, wrapped)


def wrap_listener(wrap: Callable[[Any], Any]) -> None:
    """Make the capture extension of this process attach ``wrap(listener)`` to every runner."""
    runner_adapter = adapters.runner_adapter
    view = type(adapters)(f"uhead_adapters_{wrap.__name__}")
    view.__dict__.update({k: v for k, v in vars(adapters).items() if not k.startswith("__")})
    view.runner_adapter = lambda runner: _Wrapped(runner_adapter(runner), wrap)
    extension.adapters = view
