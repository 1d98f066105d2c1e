"""uhead_vllm: exact single-pass hidden-state capture in vLLM, and uncertainty heads on top of it.

The names below are the public API. Layers of the package: worker side inside vLLM
(:mod:`uhead_vllm.capture`), vLLM-version adapters (:mod:`uhead_vllm.adapters`), engine side
(:mod:`uhead_vllm.generation`), features and heads (:mod:`uhead_vllm.features`,
:mod:`uhead_vllm.heads`), the main job (:mod:`uhead_vllm.scoring`), integrations
(:mod:`uhead_vllm.polygraph`, :mod:`uhead_vllm.thinkbooster`, :mod:`uhead_vllm.serving`) and the
research pipeline (:mod:`uhead_vllm.study`).
"""

from .adapters.versions import SUPPORTED_VLLM, UnsupportedVllmError
from .errors import EngineDeadError, InputError, MissingExtraError, UheadError
from .features import FeatureRecipe, StepSpan, split_steps, step_token_features
from .generation import (
    CaptureError,
    CaptureNotInstalledError,
    GenerationStats,
    HiddenStatesGeneration,
    MissingRowsError,
    SampleHiddenStates,
    StepRecord,
    VllmHiddenStatesGenerator,
    build_llm,
    capture_engine_kwargs,
)
from .heads import (
    AttentionPoolingHead,
    HeadFormatError,
    HeadMismatchError,
    HeadUsage,
    LinearProbeHead,
    RankingProbeHead,
    UncertaintyHead,
    default_head_dir,
    load_head,
    load_head_for_model,
    ranking_head_dir,
)
from .models import embedded_model_path, model_identity, resolve_model
from .scoring.answer import answer

__version__ = "0.1.0"

__all__ = [
    # generation with exact hidden states
    "VllmHiddenStatesGenerator", "build_llm", "capture_engine_kwargs", "HiddenStatesGeneration",
    "SampleHiddenStates", "StepRecord", "GenerationStats",
    # errors (all derive from UheadError)
    "UheadError", "InputError", "EngineDeadError", "MissingExtraError", "CaptureError", "CaptureNotInstalledError",
    "MissingRowsError", "UnsupportedVllmError", "HeadMismatchError", "HeadFormatError",
    # features and heads
    "FeatureRecipe", "StepSpan", "split_steps", "step_token_features", "UncertaintyHead",
    "LinearProbeHead", "AttentionPoolingHead", "RankingProbeHead", "HeadUsage", "load_head", "load_head_for_model",
    "default_head_dir", "ranking_head_dir",
    # the main job
    "answer",
    # models and versions
    "embedded_model_path", "model_identity", "resolve_model", "SUPPORTED_VLLM",
]
