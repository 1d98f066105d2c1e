"""process_output_fn / process_target_fn for AccuracyMetric on arithmetic answers.

polygraph_eval loads this file by path (process_output_fn.path, relative to the main config); the
functions live in :mod:`uhead_vllm.polygraph.processing`.
"""

from uhead_vllm.polygraph.processing import answer_from_output, answer_from_target

__all__ = ["answer_from_output", "answer_from_target"]
