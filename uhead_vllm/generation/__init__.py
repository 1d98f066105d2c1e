"""Engine side: builds capturing engines, assembles exact rows, caches prefixes and steps."""

from .engine import CaptureClient, CaptureNotInstalledError, build_llm, capture_engine_kwargs
from .generator import (
    CaptureError,
    GenerationStats,
    HiddenStatesGeneration,
    MissingRowsError,
    SampleHiddenStates,
    VllmHiddenStatesGenerator,
)
from .prefix_store import PrefixRowStore
from .step_cache import StepCache, StepRecord

__all__ = [
    "CaptureClient", "CaptureNotInstalledError", "build_llm", "capture_engine_kwargs", "CaptureError",
    "GenerationStats", "HiddenStatesGeneration", "MissingRowsError", "SampleHiddenStates",
    "VllmHiddenStatesGenerator", "PrefixRowStore", "StepCache", "StepRecord",
]
