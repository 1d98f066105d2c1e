"""The product's scoring: a head applied to generated answers (the main job ``uhead-vllm answer``).

- :mod:`.prompts`: the chat prompt styles, ``build_chat``, example questions;
- :mod:`.arithmetic`: the final number of an answer, the check of its "a op b = c" lines;
- :mod:`.recipe`: how answers are generated and cut into steps (``GenerationRecipe``, the job's engine);
- :mod:`.spans`: one answer's tensors, a span's features, an answer's P(wrong) from its spans;
- :mod:`.scored`: scored answers and steps, the answers of one engine call scored by a head;
- :mod:`.units`: the main job in units of questions, here or on Ray actors;
- :mod:`.answer`: the main job (:func:`uhead_vllm.answer`) and its table.

The research pipeline (:mod:`uhead_vllm.study`) and the server build on these; nothing here
imports them. This package re-exports no function named like one of its modules.
"""

from .answer import format_table
from .prompts import PROMPT_STYLES
from .recipe import GenerationRecipe, build_job_generator
from .scored import ScoredAnswer, ScoredStep, answer_questions, score_generation
from .spans import AnswerArrays, SpanBatch, answer_scores, logprob_arrays, span_features

__all__ = [
    "AnswerArrays", "GenerationRecipe", "PROMPT_STYLES", "ScoredAnswer", "ScoredStep", "SpanBatch",
    "answer_questions", "answer_scores", "build_job_generator", "format_table", "logprob_arrays",
    "score_generation", "span_features",
]
