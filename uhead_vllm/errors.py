"""The package's base exception.

Every error uhead_vllm raises on purpose derives from :class:`UheadError` (and from the builtin
it always derived from, so existing ``except ValueError`` code keeps working); the CLI turns each
into one line and an exit code instead of a traceback. Errors of the worker side
(``uhead_vllm.capture``), which imports nothing from the rest of the package, are listed in
:data:`WORKER_ERRORS` instead.
"""

from __future__ import annotations

from typing import ClassVar


class UheadError(Exception):
    """Base of uhead_vllm's errors. ``exit_code``: 2 = bad input (model, head, data, arguments),
    1 = a failure while running (capture, engine)."""

    exit_code: ClassVar[int] = 1


class InputError(UheadError):
    """The caller gave something unusable (a missing model, a head for another model, bad data)."""

    exit_code: ClassVar[int] = 2


class EngineDeadError(UheadError, RuntimeError):
    """The vLLM engine died earlier (e.g. a crash in a previous call); build a new one."""


def worker_errors() -> tuple[type[BaseException], ...]:
    """Errors raised by the worker-side capture code (kept free of engine-side imports)."""
    from .capture.architectures import EngineDefectError, UnknownArchitectureError

    return (EngineDefectError, UnknownArchitectureError)
