"""Engine side: builds capturing engines, assembles exact rows, caches prefixes and steps."""

from .backends import BACKENDS, CaptureNotInstalledError, capture_engine_kwargs, open_capture_client
from .backends import AuxClient as CaptureClient
from .engine import SMALL_CPU_ENGINE, UnsupportedModelError, build_generator, build_llm
from ..errors import CaptureError, MissingRowsError
from .generator import VllmHiddenStatesGenerator
from .results import GenerationStats, HiddenStatesGeneration, SampleHiddenStates
from .prefix_store import PrefixRowStore
from .step_cache import StepCache, StepRecord
from .steering import SteeringError

__all__ = [
    "BACKENDS", "CaptureClient", "CaptureNotInstalledError", "open_capture_client", "build_llm", "build_generator",
    "SMALL_CPU_ENGINE", "capture_engine_kwargs", "CaptureError",
    "GenerationStats", "HiddenStatesGeneration", "MissingRowsError", "SampleHiddenStates",
    "VllmHiddenStatesGenerator", "PrefixRowStore", "StepCache", "StepRecord", "SteeringError",
    "UnsupportedModelError",
]
