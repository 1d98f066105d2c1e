"""Labelled arithmetic tasks for the uncertainty study (pure Python, no vLLM).

The study needs questions whose answers a 135M model gets *sometimes* right, a grader that turns
its free-form output into a right/wrong label, and per-step labels for step-level heads. Questions
come from reasoning-gym (procedural, offline, with its own scorers); the configurations in `TASKS`
are the easy ones DESIGN.md measured to give a usable right/wrong mix for SmolLM2-135M-Instruct.

Prompts and the reading of answers are the product's (:mod:`uhead_vllm.scoring.prompts`,
:mod:`uhead_vllm.scoring.arithmetic`); this module grades and labels with them and re-exports the
ones the study names from here (``build_chat``, ``extract_answer``, ``normalize_number``,
``safe_eval``, ``check_step_line``).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable

from .errors import require
from .scoring.arithmetic import check_step_line, extract_answer, normalize_number, safe_eval
from .scoring.prompts import build_chat

__all__ = [
    "Question",
    "TaskSpec",
    "TASKS",
    "load_questions",
    "build_chat",
    "extract_answer",
    "normalize_number",
    "grade",
    "safe_eval",
    "check_step_line",
    "label_steps",
    "save_questions_jsonl",
    "load_questions_jsonl",
    "write_polygraph_dataset",
]


# --------------------------------------------------------------------------------------------
# Questions and the task registry
# --------------------------------------------------------------------------------------------


@dataclass
class Question:
    """One labelled question; `entry` is reasoning-gym's raw entry, kept for its scorer."""

    task: str
    qid: str
    question: str
    answer: str
    entry: dict = field(repr=False)


@dataclass(frozen=True)
class TaskSpec:
    """A named reasoning-gym configuration: `dataset` name plus config kwargs for create_dataset."""

    dataset: str
    config: dict
    description: str = ""


# Keys of `config` are the field names of reasoning-gym's config dataclasses
# (BasicArithmeticDatasetConfig, ChainSumConfig, DecimalChainSumConfig, GSMSymbolicDatasetConfig).
TASKS: dict[str, TaskSpec] = {
    "basic_arithmetic": TaskSpec(
        "basic_arithmetic",
        dict(
            min_terms=2,
            max_terms=2,
            min_digits=1,
            max_digits=2,
            operators=("+", "-", "*"),
            allow_parentheses=False,
            allow_negation=False,
        ),
        "a op b, operands 0..100, + - *; SmolLM2-135M ~31-36% correct",
    ),
    "chain_sum": TaskSpec(
        "chain_sum",
        dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, allow_negation=False),
        "a +/- b with one-digit operands; SmolLM2-135M ~27-28% correct",
    ),
    "chain_sum_3": TaskSpec(
        "chain_sum",
        dict(min_terms=3, max_terms=3, min_digits=1, max_digits=2, allow_negation=False),
        "a +/- b +/- c with 1-2 digit operands; harder",
    ),
    "chain_sum_3x1": TaskSpec(
        "chain_sum",
        dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1, allow_negation=False),
        "a +/- b +/- c with one-digit operands: two operations (value study's unseen task)",
    ),
    "gsm_symbolic": TaskSpec("gsm_symbolic", {}, "reasoning-gym default; near 0% for a 135M model"),
    # Candidates with more steps (the second value study; chosen on validation, see
    # experiments/value/PREREGISTRATION.md). Answers are numbers, so the committed question files
    # are graded by numeric equality and their "a op b = c" lines by check_step_line.
    "chain_sum_4": TaskSpec(
        "chain_sum",
        dict(min_terms=4, max_terms=4, min_digits=1, max_digits=2, allow_negation=False),
        "a +/- b +/- c +/- d with 1-2 digit operands: three operations",
    ),
    "basic_arithmetic_3": TaskSpec(
        "basic_arithmetic",
        dict(
            min_terms=3,
            max_terms=3,
            min_digits=1,
            max_digits=2,
            operators=("+", "-", "*"),
            allow_parentheses=False,
            allow_negation=False,
        ),
        "a op b op c, operands 0..99, + - *: two operations and their precedence",
    ),
    "decimal_chain_sum_3": TaskSpec(
        "decimal_chain_sum",
        dict(min_terms=3, max_terms=3, min_digits=1, max_digits=2, min_decimal_places=1, max_decimal_places=1,
             allow_negation=False),
        "a +/- b +/- c with one-decimal operands below 100",
    ),
    "basic_arithmetic_default": TaskSpec(
        "basic_arithmetic", {}, "reasoning-gym default: 2-6 terms of 1-4 digits, + - * /, parentheses, negation"
    ),
    "chain_sum_default": TaskSpec("chain_sum", {}, "reasoning-gym default: 2-6 terms of 1-4 digits, + -"),
    # Intermediate candidates, between the first round's 2-term tasks and the ones above. Easier
    # ones (2-3 one-digit chain sums, 2-term products below 101) lie wholly inside the expression
    # spaces the earlier studies used, which the second study's de-duplication excludes.
    "basic_arithmetic_3x1": TaskSpec(
        "basic_arithmetic",
        dict(
            min_terms=3,
            max_terms=3,
            min_digits=1,
            max_digits=1,
            operators=("+", "-", "*"),
            allow_parentheses=False,
            allow_negation=False,
        ),
        "a op b op c, operands 0..10, + - * (the + - only expressions are excluded as earlier sets)",
    ),
    "addition_4x1": TaskSpec(
        "basic_arithmetic",
        dict(min_terms=4, max_terms=4, min_digits=1, max_digits=1, operators=("+",), allow_parentheses=False,
             allow_negation=False),
        "a + b + c + d, operands 0..10: three additions, no negative intermediate",
    ),
    "chain_sum_4x1": TaskSpec(
        "chain_sum",
        dict(min_terms=4, max_terms=4, min_digits=1, max_digits=1, allow_negation=False),
        "a +/- b +/- c +/- d with one-digit operands: three operations",
    ),
    "addition_2x3": TaskSpec(
        "basic_arithmetic",
        dict(min_terms=2, max_terms=2, min_digits=3, max_digits=3, operators=("+",), allow_parentheses=False,
             allow_negation=False),
        "a + b, operands 0..1000: one addition with carries",
    ),
    "simple_equations_easy": TaskSpec(
        "simple_equations",
        dict(min_terms=2, max_terms=2, min_value=1, max_value=12),
        "one linear equation 'c*x op a = b' (or x op a), values 1..12, integer solution 1..12",
    ),
}


def _spec(task: str) -> TaskSpec:
    try:
        return TASKS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; known: {sorted(TASKS)}") from None


def _jsonable(x: Any) -> Any:
    """Copy `x` into plain JSON types (tuples -> lists, unknown objects -> str) so entries round-trip."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted((_jsonable(v) for v in x), key=repr)
    return str(x)


def load_questions(task: str, n: int, seed: int = 0) -> list[Question]:
    """First `n` questions of `task` for `seed`; deterministic and prefix-stable in `n`.

    Beware: reasoning-gym's arithmetic datasets seed item i with `seed + i`, so (seed, i) and
    (seed + 1, i - 1) give the *same* question. Keep seeds of disjoint splits at least `n` apart.
    """
    reasoning_gym = require("reasoning_gym", "Loading reasoning-gym questions (uhead_vllm.tasks)")

    spec = _spec(task)
    ds = reasoning_gym.create_dataset(spec.dataset, size=max(n, 1), seed=seed, **spec.config)
    out = []
    for i in range(n):
        entry = _jsonable(ds[i])
        out.append(Question(task, f"{task}-s{seed}-{i}", entry["question"], str(entry["answer"]), entry))
    return out


# --------------------------------------------------------------------------------------------
# Grading
# --------------------------------------------------------------------------------------------


#: Task name of questions read from a file (:func:`load_question_file`): graded by the number.
FILE_TASK = "file"


def load_question_file(path: str | Path) -> list[Question]:
    """Questions with reference answers from a JSON-lines file, one ``{"question": ..., "answer":
    ...}`` object per line (``"id"`` optional). Graded by numeric equality (no reasoning-gym), so
    they need no extra and can be carried anywhere, e.g. to a GPU cluster."""
    path = Path(path)
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(Question(FILE_TASK, str(d.get("id", f"{path.stem}-{i}")), str(d["question"]), str(d["answer"]), {}))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{i + 1}: expected a JSON object with 'question' and 'answer' ({e})") from None
    if not out:
        raise ValueError(f"{path} holds no questions")
    return out


@lru_cache(maxsize=None)
def _scorer(task: str) -> Callable[[str | None, dict], float]:
    reasoning_gym = require("reasoning_gym", "Grading with reasoning-gym's checkers (uhead_vllm.tasks)")

    spec = _spec(task)
    return reasoning_gym.create_dataset(spec.dataset, size=1, seed=0, **spec.config).score_answer


def _numeric_equal(a: str | None, b: str | None) -> bool:
    na, nb = normalize_number(a or ""), normalize_number(b or "")
    return na is not None and nb is not None and Decimal(na) == Decimal(nb)


def grade(question: Question, response_text: str) -> tuple[bool, float]:
    """(correct, score) of a response, via reasoning-gym's own scorer on the extracted answer.

    Correct means score >= 0.999: basic_arithmetic's default scorer gives partial credit
    (len(ref)/len(answer)) when the reference is a substring, e.g. "-3" for "3" scores 0.5.
    If the scorer raises, or disagrees with exact numeric equality to the reference (a string
    scorer is stricter than the maths), numeric equality decides and the score becomes 1.0/0.0.
    """
    extracted = extract_answer(response_text)
    if extracted is None:
        return False, 0.0
    if question.task == FILE_TASK:
        ok = _numeric_equal(extracted, question.answer)
        return ok, float(ok)
    scorer = _scorer(question.task)  # a missing reasoning-gym (MissingExtraError) is not the scorer raising
    try:
        score = float(scorer(extracted, question.entry))
    except Exception:
        ok = _numeric_equal(extracted, question.answer)
        return ok, float(ok)
    if score < 0.999 and _numeric_equal(extracted, question.answer):
        return True, 1.0
    return score >= 0.999, score


# --------------------------------------------------------------------------------------------
# Step labels
# --------------------------------------------------------------------------------------------

_ANSWER_LINE_RE = re.compile(r"answer\s*:", re.IGNORECASE)


def label_steps(step_texts: list[str], final_correct: bool) -> list[int | None]:
    """Per-step WRONG labels (1 wrong, 0 right, None uncheckable) for step-level heads.

    A step containing "Answer:" takes the final answer's correctness; others are checked as
    arithmetic by `check_step_line`.
    """
    labels: list[int | None] = []
    for s in step_texts:
        if _ANSWER_LINE_RE.search(s):
            labels.append(0 if final_correct else 1)
            continue
        ok = check_step_line(s)
        labels.append(None if ok is None else int(not ok))
    return labels


# --------------------------------------------------------------------------------------------
# Persistence
# --------------------------------------------------------------------------------------------


def save_questions_jsonl(path: str | Path, questions: Iterable[Question]) -> None:
    """One JSON object per question, so a run's exact question set can be reloaded offline."""
    with open(path, "w", encoding="utf-8") as f:
        for q in questions:
            d = asdict(q)
            d["entry"] = _jsonable(d["entry"])
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def load_questions_jsonl(path: str | Path) -> list[Question]:
    """Inverse of `save_questions_jsonl`."""
    with open(path, encoding="utf-8") as f:
        return [Question(**json.loads(line)) for line in f if line.strip()]


def write_polygraph_dataset(path_csv: str | Path, questions: Iterable[Question]) -> None:
    """CSV with columns `question` (plain text) and `answer` (reference) for lm-polygraph.

    lm-polygraph (`lm_polygraph/utils/dataset.py`): `Dataset.load(path, x_column, y_column, ...)`
    takes a local path when `os.path.isfile(path)` and calls `from_csv`, which is
    `pd.read_csv(path)` then `csv[x_column]` / `csv[y_column]`; the only other argument it uses is
    `prompt`, applied as `prompt.format(text=x)`. polygraph_eval passes `args.text_column` and
    `args.label_column` as those columns, so the Hydra config needs `dataset: <abs path to csv>`,
    `text_column: question`, `label_column: answer` (optionally `prompt: "...{text}..."`).
    `eval_split`, `load_from_disk` etc. are ignored for CSV files.
    Caveat (checked): pandas infers dtypes, so an all-integer `answer` column comes back as
    Python ints, while lm-polygraph's AccuracyMetric calls `target.strip()`. Cast targets with a
    `process_target_fn: {path: ..., fn_name: ...}` hook in the config, or grade with `grade`.
    """
    with open(path_csv, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["question", "answer"])
        for q in questions:
            w.writerow([q.question, q.answer])
