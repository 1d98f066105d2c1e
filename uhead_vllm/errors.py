"""The package's base exception.

Every error uhead_vllm raises on purpose derives from :class:`UheadError` (and from the builtin
it always derived from, so existing ``except ValueError`` code keeps working); the CLI turns each
into one line and an exit code instead of a traceback. Errors of the worker side
(``uhead_vllm.capture``), which imports nothing from the rest of the package, are listed in
:data:`WORKER_ERRORS` instead.
"""

from __future__ import annotations

import importlib
from types import ModuleType
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


class MissingExtraError(UheadError, ImportError):
    """A feature needs a package of an optional extra that is not installed.

    The core install (``pip install uhead-vllm``) is the capture library; studies, plots, the
    lm-polygraph configs and the embedded-model conversion need extras (see ``pyproject.toml``).
    """

    exit_code: ClassVar[int] = 2


#: Optional packages -> (pip name, extra that brings it).
EXTRAS: dict[str, tuple[str, str]] = {
    "reasoning_gym": ("reasoning-gym", "study"),
    "matplotlib": ("matplotlib", "study"),
    "hydra": ("hydra-core", "polygraph"),
    "omegaconf": ("hydra-core", "polygraph"),
    "gguf": ("gguf", "embedded"),
    "accelerate": ("accelerate", "embedded"),
    "ray": ("ray", "ray"),
}


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (a key of :data:`EXTRAS` or a submodule of one) for ``feature``, or raise
    :class:`MissingExtraError` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        pip_name, extra = EXTRAS[top]
        raise MissingExtraError(
            f"{feature} needs the package '{pip_name}', which is not installed "
            f"({type(e).__name__}: {e}). Install the extra: pip install 'uhead-vllm[{extra}]'"
        ) from e


def worker_errors() -> tuple[type[BaseException], ...]:
    """Errors raised by the worker-side capture code (kept free of engine-side imports)."""
    from .capture.architectures import EngineDefectError, UnknownArchitectureError
    from .capture.steering import SteerSpecError

    return (EngineDefectError, UnknownArchitectureError, SteerSpecError)
