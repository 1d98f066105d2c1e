"""The second value study's committed question files: reproducible, disjoint, gradable (no engine)."""

import json

import pytest

from experiments.thinkbooster.heldout import head_study
from experiments.value import make_questions as mq
from uhead_vllm import tasks
from uhead_vllm.heads import default_head_dir, load_head


def _committed() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(mq.OUT.iterdir())}


def test_committed_files_are_the_scripts_output():
    built = mq.build()  # also asserts disjointness (check_disjoint)
    committed = _committed()
    assert sorted(committed) == sorted(built)
    for name, text in built.items():
        assert committed[name] == text, f"{name} differs from make_questions' output"


def test_committed_files_are_disjoint_from_each_other_and_earlier_sets():
    files = _committed()
    mq.check_disjoint(files, mq.earlier_keys())
    manifest = json.loads(files["MANIFEST.json"])
    for name, entry in manifest["splits"].items():
        rows = [json.loads(line) for line in files[name].splitlines()]
        assert len(rows) == entry["questions"] == mq.SPLITS[entry["split"]][1]
        assert len({r["id"] for r in rows}) == len(rows)


def test_check_disjoint_catches_a_shared_expression():
    files = _committed()
    line = files["chain_sum_4.test.jsonl"].splitlines()[0] + "\n"
    with pytest.raises(AssertionError, match="also in"):
        mq.check_disjoint({"a.jsonl": line, "b.jsonl": line}, set())
    with pytest.raises(AssertionError, match="earlier"):
        mq.check_disjoint({"a.jsonl": line}, {json.loads(line)["key"]})


def test_earlier_keys_cover_real_earlier_sets():
    """The exclusion set holds the questions the earlier studies and the default head really used."""
    earlier = mq.earlier_keys()
    plans = [t for ds in head_study(load_head(default_head_dir())).get("datasets", []) for t in ds["tasks"]]
    assert plans, "the default head records its training plan"
    used = [(p["task"], p["seed"], 2 * p["n"]) for p in plans] + [
        ("basic_arithmetic", 200_000, 600), ("chain_sum", 400_000, 400), ("chain_sum_3", 600_000, 300),
        ("basic_arithmetic", 1_000_000, 600), ("chain_sum_3x1", 3_000_000, 400),
    ]
    for task, seed, n in used:
        missing = [q.question for q in tasks.load_questions(task, n, seed) if mq.question_key(q) not in earlier]
        assert not missing, f"{task} seed {seed}: {missing[:3]}"


def test_reference_answers_grade_right():
    for name, text in _committed().items():
        if not name.endswith(".jsonl"):
            continue
        for row in map(json.loads, text.splitlines()[:50]):
            q = tasks.Question(tasks.FILE_TASK, row["id"], row["question"], row["answer"], {})
            assert tasks.grade(q, f"Answer: {row['answer']}")[0], (name, row)


def test_a_later_round_leaves_earlier_files_unchanged(monkeypatch):
    """Tasks added in a later round draw after every split of the earlier rounds."""
    first = mq.ROUNDS[0]
    monkeypatch.setattr(mq, "ROUNDS", (first,))
    monkeypatch.setattr(mq, "TASK_OFFSETS", {t: mq.TASK_OFFSETS[t] for t in first})
    committed = _committed()
    built = mq.build()
    assert {n for n in built if n.endswith(".jsonl")} == {f"{t}.{s}.jsonl" for t in first for s in mq.SPLITS}
    for name, text in built.items():
        if name.endswith(".jsonl"):
            assert committed[name] == text, f"{name} changes when a later round is added"


def test_equation_key_ignores_the_variable_letter():
    def q(equation: str, variable: str) -> tasks.Question:
        meta = {"equation": equation, "variable": variable}
        return tasks.Question("simple_equations_easy", "q", f"Solve for {variable}: {equation}", "1", {"metadata": meta})

    assert mq.question_key(q("3*h + 4 = 7", "h")) == mq.question_key(q("3*k + 4 = 7", "k")) == "3*x+4=7"
    assert mq.question_key(q("3*h + 4 = 7", "h")) != mq.question_key(q("3*h + 5 = 8", "h"))
