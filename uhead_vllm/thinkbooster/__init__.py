"""thinkbooster integration: uncertainty heads as the step scorer of its vLLM strategies.

thinkbooster itself is an optional extra (``pip install --no-deps thinkbooster==0.1.1`` plus
``pip install -e ".[thinkbooster]"``); only :mod:`.strategies` imports it.
"""

from ..heads import default_head_dir
from .build import build_uhead_model, load_step_head, make_scorer
from .model import CandidateHandle, ScoredRequestOutput, ScoreRecord, UHeadVLLMModel
from .scorers import (
    CandidateStep,
    HeadScorer,
    MeanNLLScorer,
    MeanTokenEntropyScorer,
    RandomScorer,
    StepScorer,
    probability_to_uncertainty,
)

__all__ = [
    "UHeadVLLMModel", "CandidateHandle", "ScoreRecord", "ScoredRequestOutput",
    "build_uhead_model", "default_head_dir", "load_step_head", "make_scorer",
    "CandidateStep", "StepScorer", "HeadScorer", "MeanTokenEntropyScorer", "MeanNLLScorer",
    "RandomScorer", "probability_to_uncertainty",
]
