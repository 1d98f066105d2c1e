"""process_output_fn / process_target_fn for AccuracyMetric on arithmetic answers.

polygraph_eval loads this file by path (process_output_fn.path, relative to the main config).
"""

from uhead_vllm.tasks import extract_answer, normalize_number


def answer_from_output(text: str) -> str:
    """The final number of a free-form answer, normalised; "" when there is none (never matches)."""
    return extract_answer(text) or ""


def answer_from_target(target) -> str:
    """Reference answer as a normalised number string (pandas may hand over an int)."""
    text = str(target).strip()
    return normalize_number(text) or text
