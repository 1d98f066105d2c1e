"""Every error uhead_vllm raises on purpose, in one module (as scikit-learn's ``exceptions.py``).

Each derives from :class:`UheadError` and from the builtin it always derived from, so existing
``except ValueError`` code keeps working; the CLI turns each into one line and an exit code
instead of a traceback. This module imports nothing from the package, so the worker side
(``uhead_vllm.capture``, which imports nothing engine-side) raises these too.
"""

from __future__ import annotations

import importlib
from pathlib import Path
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


# -- bad input (exit code 2) ----------------------------------------------------------------------


class UnsupportedVllmError(InputError, RuntimeError):
    """The installed vLLM is outside the checked range, or lacks an internal capture relies on."""


class ModelNotAvailableError(InputError, RuntimeError):
    """Raised when a model cannot be found or prepared offline."""


class UnsupportedModelError(InputError, NotImplementedError):
    """The model's architecture cannot be captured exactly (said before the engine is built)."""


class CaptureNotInstalledError(InputError, RuntimeError):
    """The vLLM engine was built without the uhead_vllm worker extension."""


class SteeringError(InputError, ValueError):
    """A request's ``uhead_steer`` spec is malformed, or the engine was built without steering."""


class HeadMismatchError(InputError, ValueError):
    """A saved head does not fit the model, layers or feature size it is being loaded for."""


class HeadFormatError(InputError, ValueError):
    """A head folder is damaged or incomplete (missing file, invalid JSON, unreadable weights)."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path} is not a complete uncertainty head: {problem}; save it again "
                         "(head.save(dir)) or retrain it (`uhead-vllm train`)")


class HeadNotFoundError(InputError, FileNotFoundError):
    """The configured head directory (or one of its files) does not exist."""


class DatasetError(InputError, ValueError):
    """A dataset directory is missing, incomplete or not in the expected format."""


class DatasetColumnError(InputError, KeyError):
    """A configured dataset column is not in the CSV file."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0])


class LogprobsMissingError(InputError, ValueError):
    """vLLM returned no logprobs: the sampling params were built without ``logprobs=k``."""


class ReservedKeysError(InputError, ValueError):
    """A request reached the engine with reserved ``extra_args`` keys the server did not write (HTTP 400)."""


class BadUncertaintyRequest(InputError, ValueError):
    """The client's request cannot be served as asked (answered with HTTP 400)."""


# -- failures while running (exit code 1) ---------------------------------------------------------


class CaptureError(UheadError, RuntimeError):
    """The worker reported a capture failure (e.g. memory budget). ``outputs`` keeps vLLM's results."""

    def __init__(self, message: str, outputs: list | None = None):
        super().__init__(message)
        self.outputs = outputs


class MissingRowsError(UheadError, RuntimeError):
    """Strict mode: some rows were skipped by the prefix cache and are not in the store."""


class SteerSpecError(UheadError, ValueError):
    """A steering spec that cannot be applied (says which term and why)."""


class UnknownArchitectureError(UheadError, NotImplementedError):
    """The model has no aux hidden-state interface and no entry in :data:`ARCHITECTURES`."""


class EngineDefectError(UheadError, NotImplementedError):
    """vLLM computes wrong hidden states for this architecture on this build; capture is refused."""


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
