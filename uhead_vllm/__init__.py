"""uhead_vllm: exact single-pass hidden-state capture in vLLM, and uncertainty heads on top of it.

Worker side (inside vLLM): :mod:`uhead_vllm.capture`. Engine side: :mod:`uhead_vllm.generation`.
Heads and features: :mod:`uhead_vllm.heads`, :mod:`uhead_vllm.features`.
"""

from .capture.protocol import CaptureSettings, CapturedRows, RequestTag
from .errors import EngineDeadError, InputError, UheadError
from .features import FeatureRecipe, StepSpan, split_steps, step_token_features
from .generation import (
    CaptureError,
    CaptureNotInstalledError,
    GenerationStats,
    HiddenStatesGeneration,
    MissingRowsError,
    PrefixRowStore,
    SampleHiddenStates,
    StepCache,
    StepRecord,
    VllmHiddenStatesGenerator,
    build_llm,
    capture_engine_kwargs,
)
from .heads import (
    AttentionPoolingHead,
    HeadFormatError,
    HeadMismatchError,
    LinearProbeHead,
    default_head_dir,
    load_head,
    load_head_for_model,
)
from .models import embedded_model_path, model_identity, resolve_model

__version__ = "0.1.0"

__all__ = [
    "UheadError", "InputError", "EngineDeadError", "HeadFormatError",
    "CaptureSettings", "CapturedRows", "RequestTag", "FeatureRecipe", "StepSpan", "split_steps",
    "step_token_features", "CaptureError", "CaptureNotInstalledError", "GenerationStats",
    "HiddenStatesGeneration", "MissingRowsError", "PrefixRowStore", "SampleHiddenStates", "StepCache",
    "StepRecord", "VllmHiddenStatesGenerator", "build_llm", "capture_engine_kwargs",
    "AttentionPoolingHead", "HeadMismatchError", "LinearProbeHead", "default_head_dir", "load_head",
    "load_head_for_model", "embedded_model_path",
    "model_identity", "resolve_model",
]
