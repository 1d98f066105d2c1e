"""Question files of the second value study: train / validation / test per task, disjoint by
expression across splits, tasks and every earlier question set (PREREGISTRATION.md, section 4).

    python -m experiments.value.make_questions           # (re)write experiments/value/questions/
    python -m experiments.value.make_questions --check   # exit 1 if the committed files differ

Deterministic: the same reasoning-gym version gives byte-identical files (MANIFEST.json records
the version and each file's sha256). Tasks come in rounds (``ROUNDS``, the order they were added):
within a round, splits are drawn test first, then validation, then train, each over the round's
tasks, so a larger training split never changes a test question; a later round draws after every
split of the earlier ones, so adding a round never changes an existing file.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Iterable, Iterator

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from uhead_vllm import tasks  # noqa: E402

OUT = Path(__file__).resolve().parent / "questions"
REASONING_GYM_VERSION = "0.1.25"

#: split -> (seed base, questions per task), in drawing order.
SPLITS: dict[str, tuple[int, int]] = {
    "test": (12_000_000, 1000),
    "validation": (11_000_000, 500),
    "train": (10_000_000, 2000),
}
#: Candidate tasks (uhead_vllm.tasks.TASKS) and their seed offsets: each task draws from its own
#: seed range, so two configurations of one generator do not share random streams.
TASK_OFFSETS: dict[str, int] = {
    "chain_sum_4": 0,
    "basic_arithmetic_3": 100_000,
    "decimal_chain_sum_3": 200_000,
    "gsm_symbolic": 300_000,
    "basic_arithmetic_default": 400_000,
    "chain_sum_default": 500_000,
    "basic_arithmetic_3x1": 600_000,
    "addition_4x1": 700_000,
    "chain_sum_4x1": 800_000,
    "addition_2x3": 900_000,
    "simple_equations_easy": 950_000,
}
#: Rounds of tasks, in the order they were added (each a tuple of TASK_OFFSETS keys).
ROUNDS: tuple[tuple[str, ...], ...] = (
    ("chain_sum_4", "basic_arithmetic_3", "decimal_chain_sum_3", "gsm_symbolic", "basic_arithmetic_default",
     "chain_sum_default"),
    ("basic_arithmetic_3x1", "addition_4x1", "chain_sum_4x1", "addition_2x3", "simple_equations_easy"),
)
POOL_FACTOR = 4  # at most this many draws per wanted question; keeps task seed ranges apart
#: Earlier sets drawn by seed (task, first seed, draws): the first study's held-out chain_sum_3
#: set (300 questions from seed 600,000), taken as the whole range its selection could use.
EARLIER_SEED_RANGES: tuple[tuple[str, int, int], ...] = (("chain_sum_3", 600_000, 4 * 300),)

_SPACE = re.compile(r"\s+")


def question_key(q: tasks.Question) -> str:
    """De-duplication key: the expression without whitespace; for an equation, the equation with
    its variable renamed ``x`` (the same equation in another letter is the same question); else
    the whitespace-folded text."""
    meta = q.entry.get("metadata") or {}
    if meta.get("expression"):
        return _SPACE.sub("", str(meta["expression"]))
    if meta.get("equation") and meta.get("variable"):
        return _SPACE.sub("", re.sub(rf"\b{re.escape(str(meta['variable']))}\b", "x", str(meta["equation"])))
    return _SPACE.sub(" ", q.question).strip()


def _expressions(operands: Iterable[int], ops: str, terms: int) -> Iterator[str]:
    nums = [str(n) for n in operands]
    for combo in itertools.product(nums, repeat=terms):
        for signs in itertools.product(ops, repeat=terms - 1):
            yield combo[0] + "".join(s + n for s, n in zip(signs, combo[1:]))


def earlier_keys() -> set[str]:
    """Keys of every earlier question set (a superset).

    The configurations behind the default head's training data, the first study's test and
    held-out sets, the polygraph probe/evaluation/layer-scan pools, the thinkbooster study and the
    first value study (``basic_arithmetic`` 2 terms 0..100 with + - *, ``chain_sum`` 2 terms 0..9,
    ``chain_sum_3x1`` 3 terms 0..9 with + -) are small: their whole expression spaces are excluded,
    whatever seeds were used. ``chain_sum_3`` (3 terms 0..99) is too large for that and was used
    once, so its seed range is excluded.
    """
    keys = set(_expressions(range(101), "+-*", 2)) | set(_expressions(range(10), "+-", 3))
    for task, seed, n in EARLIER_SEED_RANGES:
        keys |= {question_key(q) for q in tasks.load_questions(task, n, seed)}
    return keys


def _select(task: str, seed: int, want: int, used: set[str]) -> tuple[list[tasks.Question], int]:
    """First ``want`` questions of ``task``/``seed`` whose key is not in ``used`` (which grows)."""
    chosen, dropped = [], 0
    for q in tasks.load_questions(task, want * POOL_FACTOR, seed):
        if len(chosen) == want:
            break
        k = question_key(q)
        if k in used:
            dropped += 1
            continue
        used.add(k)
        chosen.append(q)
    if len(chosen) < want:
        raise ValueError(f"{task} at seed {seed}: only {len(chosen)} of {want} distinct new questions")
    return chosen, dropped


def build() -> dict[str, str]:
    """File name -> content of every question file and of MANIFEST.json."""
    installed = version("reasoning-gym")  # the module's own __version__ lags (0.1.25 says 0.1.19)
    if installed != REASONING_GYM_VERSION:
        raise RuntimeError(f"reasoning-gym {installed} installed, the files need {REASONING_GYM_VERSION}")
    if max(n for _, n in SPLITS.values()) * POOL_FACTOR > min(b - a for a, b in itertools.pairwise(sorted(TASK_OFFSETS.values()))):
        raise ValueError("task seed ranges overlap: raise the offsets or lower POOL_FACTOR")
    if max(TASK_OFFSETS.values()) + max(n for _, n in SPLITS.values()) * POOL_FACTOR > min(
            b - a for a, b in itertools.pairwise(sorted(base for base, _ in SPLITS.values()))):
        raise ValueError("a task's seed range reaches into another split's")
    if sorted(t for r in ROUNDS for t in r) != sorted(TASK_OFFSETS):
        raise ValueError("every task of TASK_OFFSETS belongs to exactly one round")
    earlier = earlier_keys()
    used = set(earlier)
    files: dict[str, str] = {}
    manifest: dict = {"reasoning_gym": REASONING_GYM_VERSION, "splits": {}, "earlier_keys": len(earlier)}
    for task_round, (split, (base, want)) in itertools.product(ROUNDS, SPLITS.items()):
        for task in task_round:
            offset = TASK_OFFSETS[task]
            qs, dropped = _select(task, base + offset, want, used)
            name = f"{task}.{split}.jsonl"
            files[name] = "".join(json.dumps({"id": q.qid, "question": q.question, "answer": q.answer,
                                              "key": question_key(q)}, ensure_ascii=False) + "\n" for q in qs)
            manifest["splits"][name] = {"task": task, "split": split, "seed": base + offset, "questions": len(qs),
                                        "dropped_duplicates": dropped,
                                        "sha256": hashlib.sha256(files[name].encode()).hexdigest()}
    files["MANIFEST.json"] = json.dumps(manifest, indent=1) + "\n"
    check_disjoint(files, earlier)
    return files


def check_disjoint(files: dict[str, str], earlier: set[str]) -> None:
    """Raise unless every question key occurs once over all files and in no earlier set."""
    seen: dict[str, str] = {}
    for name, text in files.items():
        if not name.endswith(".jsonl"):
            continue
        for line in text.splitlines():
            key = json.loads(line)["key"]
            if key in earlier:
                raise AssertionError(f"{name}: {key!r} is in an earlier question set")
            if key in seen:
                raise AssertionError(f"{name}: {key!r} also in {seen[key]}")
            seen[key] = name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="compare with the files in --out instead of writing")
    args = p.parse_args(argv)
    files = build()
    if args.check:
        bad = [n for n, text in files.items() if not (args.out / n).is_file() or (args.out / n).read_text(encoding="utf-8") != text]
        print("identical" if not bad else f"differ: {bad}")
        return int(bool(bad))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} files to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
