"""uhead_vllm: exact single-pass hidden-state capture in vLLM, and uncertainty heads on top of it.

The names below are the public API (20 names); everything else is imported from its subpackage, e.g.
``uhead_vllm.generation.GenerationStats``, ``uhead_vllm.errors.HeadMismatchError``,
``uhead_vllm.adapters.versions.SUPPORTED_VLLM``. Layers of the package: worker side inside vLLM
(:mod:`uhead_vllm.capture`), vLLM-version adapters (:mod:`uhead_vllm.adapters`), engine side
(:mod:`uhead_vllm.generation`), features and heads (:mod:`uhead_vllm.features`,
:mod:`uhead_vllm.heads`), the main job (:mod:`uhead_vllm.scoring`), integrations
(:mod:`uhead_vllm.polygraph`, :mod:`uhead_vllm.thinkbooster`, :mod:`uhead_vllm.serving`) and the
research pipeline (:mod:`uhead_vllm.study`).
"""

from .errors import CaptureError, InputError, MissingExtraError, MissingRowsError, UheadError
from .features import FeatureRecipe, split_steps
from .generation import (
    HiddenStatesGeneration,
    SampleHiddenStates,
    VllmHiddenStatesGenerator,
    build_llm,
    capture_engine_kwargs,
)
from .heads import AttentionPoolingHead, HeadUsage, LinearProbeHead, UncertaintyHead, default_head_dir, load_head
from .models import embedded_model_path
from .scoring.answer import answer

__version__ = "0.1.0"

__all__ = [
    # the main job
    "answer", "embedded_model_path",
    # generation with exact hidden states
    "build_llm", "capture_engine_kwargs", "VllmHiddenStatesGenerator", "HiddenStatesGeneration", "SampleHiddenStates",
    # features and heads
    "FeatureRecipe", "split_steps", "UncertaintyHead", "LinearProbeHead", "AttentionPoolingHead", "HeadUsage",
    "load_head", "default_head_dir",
    # errors (all derive from UheadError)
    "UheadError", "InputError", "CaptureError", "MissingRowsError", "MissingExtraError",
]
