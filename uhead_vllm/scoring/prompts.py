"""The chat prompts answers are generated with: every prompt style by name, and example questions.

A head scores answers prompted like its training answers (hidden states depend on the prompt),
so the style is recorded in the generation recipe (:class:`~.recipe.GenerationRecipe`) and in the
head's usage; the study prompts its labelled questions with the same table.
"""

from __future__ import annotations

from typing import Protocol

#: Questions the CLI's main jobs answer when given none.
EXAMPLE_QUESTIONS: list[str] = [
    "What is 7 + 8?",
    "What is 45 + 38?",
    "What is 6 * 7?",
    "Calculate 91 - 17 + 5.",
]

#: Prompt styles: one short user turn each, since the model is only 135M. "steps" asks for
#: "a op b = c" lines (checkable by :func:`~.arithmetic.check_step_line`) and a final
#: "Answer: <number>" line (what :func:`~.arithmetic.extract_answer` prefers); "direct" asks for
#: the answer only. SmolLM2-135M copies the worked example of "steps" ("12 + 7 = 19") into many
#: answers, so "steps_plain" is the same instruction without the example: short answers made of
#: "a op b = c" lines and an "Answer:" line.
PROMPT_STYLES: dict[str, str] = {
    "steps": (
        "Solve step by step. Write one calculation per line as \"a op b = c\". "
        "End with a line \"Answer: <number>\".\n"
        "Example:\n12 + 7 = 19\nAnswer: 19\n\n"
        "{question}"
    ),
    "direct": "Give only the result, on one line \"Answer: <number>\".\n\n{question}",
    "steps_plain": (
        "Solve step by step. Write one calculation per line as \"a op b = c\". "
        "End with a line \"Answer: <number>\".\n\n{question}"
    ),
    "explain": "Solve this and explain your calculation step by step, then give the final answer.\n\n{question}",
    "raw": "{question}",
}


class HasQuestionText(Protocol):
    """A question with more to it than its text (the study's labelled ``uhead_vllm.tasks.Question``)."""

    question: str


def build_chat(question: HasQuestionText | str, style: str = "steps") -> list[dict]:
    """Chat messages for one question in prompt style ``style`` (a key of :data:`PROMPT_STYLES`)."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {style!r}; known: {sorted(PROMPT_STYLES)}")
    text = question if isinstance(question, str) else question.question
    return [{"role": "user", "content": PROMPT_STYLES[style].format(question=text.strip())}]
