"""Tests for the labelled-task layer (reasoning-gym questions, grading, step labels)."""

import csv
import json
from decimal import Decimal

import pytest

from uhead_vllm import tasks
from uhead_vllm.tasks import (
    TASKS,
    Question,
    build_chat,
    check_step_line,
    extract_answer,
    grade,
    label_steps,
    load_questions,
    load_questions_jsonl,
    safe_eval,
    save_questions_jsonl,
    write_polygraph_dataset,
)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_load_questions_deterministic_and_serializable(task):
    a = load_questions(task, 4, seed=3)
    b = load_questions(task, 4, seed=3)
    assert a == b and len(a) == 4
    assert load_questions(task, 2, seed=3) == a[:2]  # prefix-stable in n
    assert load_questions(task, 4, seed=1000) != a
    assert len({q.qid for q in a}) == 4
    for q in a:
        assert q.task == task and q.question and q.answer == q.entry["answer"]
        json.dumps(q.entry)


def test_task_configs_are_the_easy_ones():
    for q in load_questions("basic_arithmetic", 30, seed=0):
        expr = q.entry["metadata"]["expression"]
        assert len(expr.split()) == 3 and expr.split()[1] in "+-*"
        assert "(" not in expr
    for q in load_questions("chain_sum", 30, seed=0):
        a, op, b = q.entry["metadata"]["expression"].split()
        assert op in "+-" and len(a) == len(b) == 1
    for q in load_questions("chain_sum_3", 10, seed=0):
        assert len(q.entry["metadata"]["expression"].split()) == 5
    with pytest.raises(ValueError):
        load_questions("nope", 1, 0)


def test_build_chat():
    q = load_questions("basic_arithmetic", 1, 0)[0]
    msgs = build_chat(q)
    assert msgs[-1]["role"] == "user" and q.question in msgs[-1]["content"]
    assert "Answer: <number>" in msgs[-1]["content"] and "a op b = c" in msgs[-1]["content"]
    assert build_chat("What is 2 + 2?", style="direct")[0]["content"].endswith("What is 2 + 2?")
    with pytest.raises(ValueError):
        build_chat(q, style="poem")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("5 * 33 = 165\nAnswer: 165", "165"),
        ("Answer: 15", "15"),
        ("**Answer:** $1,000.00", "1000"),
        ("The answer is -4.", "-4"),
        ("Answer: \u22123", "-3"),
        ("7 + 8 = 15\nAnswer: 15\nI hope this helps! Let me know if 2 more.", "15"),
        ("Answer: 12\nCheck: 3 * 4 = 12, and 12 - 2 = 10", "12"),  # Answer: wins over later '='
        ("To find the sum, 45 + 38 = 83. So Robert has 83 apples left.", "83"),
        ("First 4 - 9 = -5", "-5"),
        ("The total is 1,234 dollars", "1234"),
        ("I think it is 12, no wait, 13", "13"),
        ("Answer: 15.0", "15"),
        ("The result is 2.50", "2.5"),
        ("\\boxed{42}", "42"),
        ("5-3", "3"),
        ("I do not know.", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("task", sorted(TASKS))
def test_grade_real_entries(task):
    for q in load_questions(task, 3, seed=0):
        ref = Decimal(q.answer)  # decimal tasks have answers like "-16.0"
        assert grade(q, f"Let me compute.\nAnswer: {ref}") == (True, 1.0)
        assert grade(q, f"so the result = {ref:,}" + ("0" if "." in q.answer else ".0"))[0]  # grouped, trailing zero
        ok, score = grade(q, f"Answer: {ref + 1}")
        assert not ok and score < 0.999
        assert grade(q, "no idea") == (False, 0.0)


def test_grade_partial_credit_is_wrong():
    q = next(q for q in load_questions("basic_arithmetic", 50, 0) if int(q.answer) > 1)
    ok, score = grade(q, f"Answer: -{q.answer}")  # reference is a substring -> partial credit
    assert not ok and 0 < score < 0.999


def test_grade_falls_back_to_numeric_equality(monkeypatch):
    q = load_questions("chain_sum", 1, 0)[0]

    def broken(answer, entry):
        raise RuntimeError("scorer exploded")

    monkeypatch.setattr(tasks, "_scorer", lambda task: broken)
    assert grade(q, f"Answer: {q.answer}") == (True, 1.0)
    assert grade(q, "Answer: 999") == (False, 0.0)


@pytest.mark.parametrize(
    "line,expected",
    [
        ("7 + 8 = 15", True),
        ("45 + 38 = 112", False),
        ("So 3 * 4 = 12.", True),
        ("12 × 3 = 36", True),
        ("12 ÷ 3 = 5", False),
        ("(2+3)*4 = 20", True),
        ("4 \u2212 7 = \u22123", True),
        ("1,200 + 300 = 1,500", True),
        ("**Step 2.** 3 x 4 = 12", True),
        ("3 * 4 = 12 + 1 = 14", False),  # chain checked link by link
        ("10 / 3 = 3.33", True),  # rounded to the stated decimals
        ("The answer is 5", None),
        ("x = 5", None),
        ("5 apples + 3 apples = 8 apples", None),
        ("2**3 = 8", None),
        ("5 / 0 = 1", None),
        ("__import__('os').system('echo hi') = 0", None),
        ("", None),
    ],
)
def test_check_step_line(line, expected):
    assert check_step_line(line) is expected


def test_safe_eval_rejects_code(monkeypatch):
    called = []
    monkeypatch.setattr("builtins.__import__", lambda *a, **k: called.append(a))
    try:
        assert safe_eval("__import__('os')") is None
        assert safe_eval("(1).__class__") is None
        assert safe_eval("abs(-1)") is None
        assert safe_eval("2 ** 10") is None
        assert safe_eval("9" * 300) is None  # length cap
    finally:
        monkeypatch.undo()
    assert called == []
    assert safe_eval("-(2 + 3) * 4 / 8") == -2.5
    assert safe_eval("1 / 0") is None


def test_label_steps():
    steps = ["45 + 38 = 83", "83 - 9 = 75", "Now we add them up.", "Answer: 75"]
    assert label_steps(steps, final_correct=False) == [0, 1, None, 1]
    assert label_steps(steps, final_correct=True) == [0, 1, None, 0]
    assert label_steps([], True) == []


def test_jsonl_and_polygraph_csv_roundtrip(tmp_path):
    qs = load_questions("chain_sum", 3, 0) + load_questions("gsm_symbolic", 2, 0)
    save_questions_jsonl(tmp_path / "q.jsonl", qs)
    back = load_questions_jsonl(tmp_path / "q.jsonl")
    assert back == qs and all(isinstance(q, Question) for q in back)
    assert grade(back[0], f"Answer: {back[0].answer}")[0]

    write_polygraph_dataset(tmp_path / "q.csv", qs)
    with open(tmp_path / "q.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["question"] for r in rows] == [q.question for q in qs]
    assert [r["answer"] for r in rows] == [q.answer for q in qs]


def test_question_file_is_graded_by_the_number_and_rejects_bad_lines(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "What is 2 + 3?", "answer": "5"}\n\n{"id": "q7", "question": "6 * 7?", "answer": 42}\n')
    qs = tasks.load_question_file(path)
    assert [(q.task, q.qid, q.answer) for q in qs] == [("file", "mine-0", "5"), ("file", "q7", "42")]
    assert tasks.grade(qs[0], "2 + 3 = 5\nAnswer: 5") == (True, 1.0)
    assert tasks.grade(qs[1], "Answer: 42.0") == (True, 1.0)
    assert tasks.grade(qs[1], "Answer: 41") == (False, 0.0)
    path.write_text('{"question": "What is 2 + 3?"}\n')
    with pytest.raises(ValueError, match="mine.jsonl:1: expected a JSON object with 'question' and 'answer'"):
        tasks.load_question_file(path)
