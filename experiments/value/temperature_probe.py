"""Which sampling temperature should the value study's candidates use?

Best-of-n can only pick a right candidate that was sampled: a temperature too low gives n copies of
the greedy answer, one too high makes every candidate worse. This probe samples ``n`` whole answers
per question at several temperatures on *training* questions (never the study's) and reports the
mean accuracy of one sample, pass@n (the ceiling of any chooser) and majority@n:

    python -m experiments.value.temperature_probe --questions 300 --temperatures 0 0.3 0.5 0.7 1.0

Writes ``experiments/results/value/temperature_probe.json`` stamped with the commit and command.
Other options (engine, work dir) are those of ``run_value_study``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.value import run_value_study as study


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--questions", type=int, default=300, help="first N training questions of --train-task")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 1.0])
    p.add_argument("--samples", type=int, default=4, help="answers per question (n)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=study.REPO / "experiments" / "results" / "value" / "temperature_probe.json")
    own, rest = p.parse_known_args(argv)
    args = study.parse_args(rest)

    from uhead_vllm.study.value.search import majority_vote, sample_answers
    from uhead_vllm.tasks import extract_answer, grade

    qs = study._questions(args.work, args.train_task, "train", own.questions)
    session = study.Session(args)
    ex = session.expander(qs, seed=own.seed, heads={})
    rows = []
    for t in own.temperatures:
        n = 1 if t == 0 else own.samples
        start = time.perf_counter()
        answers = sample_answers(ex, n, t, args.whole_tokens, own.seed)
        right = [[grade(q, text)[0] for text, _ in a] for q, a in zip(qs, answers)]
        row = {"temperature": t, "n": n,
               "accuracy": sum(map(sum, right)) / (n * len(qs)),
               f"pass@{own.samples}": sum(any(r) for r in right) / len(qs) if n > 1 else None,
               f"majority@{own.samples}": (sum(grade(q, majority_vote(a, extract_answer)[0])[0]
                                               for q, a in zip(qs, answers)) / len(qs)) if n > 1 else None,
               "tokens_per_answer": sum(t_ for a in answers for _, t_ in a) / (n * len(qs)),
               "wall_s": round(time.perf_counter() - start, 1)}
        rows.append(row)
        study._say(json.dumps(row))
    out = {"commit": study._commit(),
           "command": "python -m experiments.value.temperature_probe " + " ".join(sys.argv[1:] if argv is None else argv),
           "task": args.train_task, "split": "train", "questions": len(qs), "rows": rows}
    own.out.parent.mkdir(parents=True, exist_ok=True)
    own.out.write_text(json.dumps(out, indent=2))
    study._say(f"wrote {own.out}")


if __name__ == "__main__":
    main()
