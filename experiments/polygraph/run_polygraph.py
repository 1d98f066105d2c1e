"""polygraph_eval with an uncertainty head on the embedded model: data, head, run, results table.

    python experiments/polygraph/run_polygraph.py                 # 300 eval questions, 300 train
    python experiments/polygraph/run_polygraph.py --head default --out experiments/results/polygraph_default_head

1. Writes the evaluation CSV (reasoning-gym basic_arithmetic, easy config) with
   ``tasks.write_polygraph_dataset`` where the Hydra config expects it. The evaluation questions
   (seed ``EVAL_SEED``) exclude, by text, every question the head was trained on: the default
   head's study training questions (re-drawn from the task plans saved in its config), or the
   probe's training questions; the script asserts the two sets are disjoint.
2. Head: ``--head DIR`` (or ``default``: the shipped head, trained on the study's prompt and on
   lines), else a linear probe trained here for this prompt and for whole answers, on training
   questions (disjoint seeds) through the same calculators polygraph_eval runs; layer, pooling and
   C are picked by 5-fold CV on the training answers only.
3. Runs lm-polygraph's own ``polygraph_eval`` (unmodified) with configs/polygraph/polygraph_eval_arith.yaml.
4. Reads the metrics table and per-sample values from polygraph_eval's log (plain text; the
   pickled manager file is never loaded) and writes results.md / results.json, adding ROC-AUC and
   claim-level (per answer line) scores that polygraph_eval has no offline ground truth for.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "polygraph" / "polygraph_eval_arith.yaml"
CANDIDATE_LAYERS = (5, 10, 15, 20, 25, 30)
# Evaluation questions: seed 300000. reasoning-gym seeds item i with seed + i, so this is far from
# the default head's training plan (basic_arithmetic:1000:0), the study's test (200000+) and
# held-out (400000+, 600000+) sets, the layer scan (900000+) and the probe's pool (100000+).
EVAL_SEED = 300_000
PROBE_SEED = 100_000

# Before torch/vLLM start: one OpenMP thread. On a shared 2-core machine, 2-thread OpenMP barriers
# wait for descheduled threads at every parallel region (measured: 16 tokens of one prompt took
# 59 s with 2 threads under load, 1.2 s with 1).
from experiments import provenance  # noqa: E402
from uhead_vllm.runtime import set_env_defaults  # noqa: E402  (does not import vLLM)

set_env_defaults(OMP_NUM_THREADS="1")


def compose_config(overrides: list[str]) -> Any:
    """The run's Hydra config, composed the way polygraph_eval composes it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG.parent), version_base=None):
        return compose(CONFIG.stem, overrides=overrides)


# ---------------------------------------------------------------------------------- head


def train_head(cfg: Any, n_train: int, task: str, eval_questions: list[str], out: Path) -> Path:
    """Linear probe on whole-answer features of training questions; CV picks layer, pooling, C."""
    import gc

    import numpy as np
    from sklearn.model_selection import StratifiedKFold

    from uhead_vllm import tasks
    from uhead_vllm.features import FeatureRecipe
    from uhead_vllm.heads import HeadUsage, LinearProbeHead
    from uhead_vllm.metrics import roc_auc
    from uhead_vllm.models import model_identity, resolve_model
    from uhead_vllm.polygraph import UheadWhiteboxModelvLLM, load_capture_llm
    from uhead_vllm.polygraph.training import collect_features

    seen = set(eval_questions)
    pool = tasks.load_questions(task, 3 * n_train, seed=PROBE_SEED)
    questions = [q for q in pool if q.question not in seen][:n_train]
    assert not seen & {q.question for q in questions}, "probe training questions overlap the evaluation questions"
    args = {k: v for k, v in dict(cfg.model.load_model_args).items() if k not in ("head_path", "capture_layers", "check_dataset")}
    t0 = time.time()
    llm, sp = load_capture_llm(cfg.model.path, cfg.max_new_tokens, cfg.model.logprobs, capture_layers=CANDIDATE_LAYERS, **args)
    adapter = UheadWhiteboxModelvLLM(llm, sp, instruct=cfg.model.instruct, **dict(cfg.model.adapter))
    texts = [cfg.prompt.format(text=q.question) for q in questions]
    col = collect_features(adapter, texts, FeatureRecipe(layers=list(CANDIDATE_LAYERS)), cfg.max_new_tokens, cfg.batch_size)
    collect_s = time.time() - t0
    identity = model_identity(resolve_model(cfg.model.path))
    del adapter, llm
    gc.collect()

    y = np.array([0 if tasks.grade(q, a)[0] else 1 for q, a in zip(questions, col.texts)])
    hidden = identity["hidden_size"]
    def layer_feats(j: int) -> list:
        return [f[:, j * hidden : (j + 1) * hidden] for f in col.sequence_features]

    cv = []
    folds = list(StratifiedKFold(5, shuffle=True, random_state=0).split(np.zeros(len(y)), y))
    for j, layer in enumerate(CANDIDATE_LAYERS):
        feats = layer_feats(j)
        for pooling in ("mean", "mean_last"):
            for c in (0.01, 0.1, 1.0):
                scores = np.empty(len(y))
                for tr, te in folds:
                    head = LinearProbeHead(recipe=FeatureRecipe([layer], pooling), C=c).fit([feats[i] for i in tr], y[tr])
                    scores[te] = head.predict_proba([feats[i] for i in te])
                cv.append({"layer": layer, "pooling": pooling, "C": c, "cv_roc_auc": roc_auc(y, scores)})
    best = max(cv, key=lambda r: r["cv_roc_auc"])
    j = CANDIDATE_LAYERS.index(best["layer"])
    head = LinearProbeHead(recipe=FeatureRecipe([best["layer"]], best["pooling"]), model_identity=identity, C=best["C"])
    head.fit(layer_feats(j), y)
    head.training_summary_.update(task=task, n_questions=len(questions), question_seed=PROBE_SEED)
    head.usage = HeadUsage.for_level("answer")  # trained on whole answers, prompted by the polygraph config
    head_dir = head.save(out / "head")
    (out / "head_training.json").write_text(json.dumps({
        "task": task, "n_train": len(questions), "wrong_rate": float(y.mean()), "collect_seconds": round(collect_s, 1),
        "chosen": best, "cv": cv, "example_answers": col.texts[:5],
        "training_questions": [q.question for q in questions],
    }, indent=2) + "\n")
    print(f"head: layer {best['layer']} {best['pooling']} C={best['C']} cv ROC-AUC {best['cv_roc_auc']:.3f} "
          f"({len(questions)} answers, {y.mean():.0%} wrong, {collect_s:.0f} s)", flush=True)
    return head_dir


def head_training_questions(head_dir: Path) -> set[str] | None:
    """Question texts a saved head was trained on, or None where the head does not say.

    Study heads save their datasets' task plans (``training.study.datasets[].tasks``: task, n,
    seed); the questions are re-drawn with the study's own selection (``select_questions``).
    Heads trained by this script list them in ``head_training.json`` next to the head folder.
    """
    from uhead_vllm.study.collect import TaskPlan, select_questions

    cfg = json.loads((head_dir / "config.json").read_text())
    plans = [t for d in cfg.get("training", {}).get("study", {}).get("datasets", []) for t in d.get("tasks", [])]
    if plans:
        out: set[str] = set()
        for t in plans:
            chosen = select_questions(TaskPlan(t["task"], int(t["n"]), int(t["seed"])))
            if len(chosen) != int(t.get("selected", t["n"])):
                raise RuntimeError(f"re-drew {len(chosen)} training questions for {t}, the head says {t.get('selected')}")
            out |= {q.question for q in chosen}
        return out
    side = head_dir.parent / "head_training.json"
    if side.exists() and "training_questions" in (j := json.loads(side.read_text())):
        return set(j["training_questions"])
    return None


def eval_questions(task: str, n: int, exclude: set[str]) -> list[Any]:
    """``n`` distinct questions of ``task`` drawn with ``EVAL_SEED``, none of them in ``exclude``."""
    from uhead_vllm.study.collect import TaskPlan, select_questions

    questions = select_questions(TaskPlan(task, n, EVAL_SEED), exclude=exclude)
    if len(questions) != n:
        raise RuntimeError(f"only {len(questions)} {task} questions outside the head's training questions")
    assert not exclude & {q.question for q in questions}, "evaluation questions overlap training questions"
    return questions


def tasks_module() -> Any:
    from uhead_vllm import tasks

    return tasks


# ---------------------------------------------------------------------------------- log parsing

_LINE = re.compile(r"\] - (\(.*?\)): (.*)$")
_STAT = re.compile(r"\] - (greedy_texts): (\[.*\])$")
_NP = re.compile(r"np\.float(?:16|32|64)\(([^()]*)\)")


def _numbers(text: str) -> list[float]:
    text = _NP.sub(r"\1", text).replace("nan", "NaN").replace("inf", "Infinity")
    return [float(x) for x in json.loads(text)]


def parse_log(path: Path) -> dict[str, Any]:
    """Metrics table and per-sample values that polygraph_eval's Logger wrote (text only)."""
    metrics: dict[tuple, float] = {}
    values: dict[tuple, list[float]] = {}
    texts: list[str] = []
    in_metrics = False
    for line in path.read_text().splitlines():
        if " METRICS " in line:
            in_metrics = True
        if m := _STAT.search(line):
            texts += ast.literal_eval(m.group(2))
            continue
        if not (m := _LINE.search(line)):
            continue
        key = ast.literal_eval(m.group(1))
        if in_metrics and len(key) == 4:
            metrics[key] = float(m.group(2))
        elif not in_metrics and len(key) == 2:
            values.setdefault(key, []).extend(_numbers(m.group(2)))
    return {"metrics": metrics, "values": values, "greedy_texts": texts}


# ---------------------------------------------------------------------------------- report


def polygraph_prr(wrong: Any, uncertainty: Any, max_rejection: float = 1.0) -> tuple[float, float]:
    """(prr, prr_normalized) exactly as polygraph_eval's table computes them (lm-polygraph's own
    ``PredictionRejectionArea``, oracle and random scores, ``normalize_metric``), for values that
    polygraph_eval has no ground truth for (claims), so both tables mean the same by "PRR"."""
    import numpy as np
    from lm_polygraph.ue_metrics import PredictionRejectionArea
    from lm_polygraph.ue_metrics.ue_metric import get_random_scores, normalize_metric

    metric = PredictionRejectionArea(max_rejection)
    quality = 1.0 - np.asarray(wrong, dtype=float)  # polygraph's target: higher = better
    ue = np.asarray(uncertainty, dtype=float)
    raw = float(metric(ue, quality))
    return raw, float(normalize_metric(raw, metric(-quality, quality), get_random_scores(metric, quality)))

METRIC_COLS = ("prr", "prr_normalized", "prr_0.5", "prr_0.5_normalized", "isotonic-pcc", "ece")


def report(parsed: dict[str, Any], questions: list[Any], out: Path, command: str, seconds: float, head_dir: Path,
           stamp: dict[str, Any] | None = None) -> dict:
    import numpy as np

    from uhead_vllm import tasks
    from uhead_vllm.metrics import roc_auc

    values, metrics = parsed["values"], parsed["metrics"]
    acc = np.array(values[("sequence", "Accuracy")])
    if len(acc) != len(questions):
        raise RuntimeError(f"log has {len(acc)} graded answers for {len(questions)} questions")
    wrong = 1 - acc
    rows = []
    estimators = [k[1] for k in values if k[0] == "sequence" and k[1] != "Accuracy"]
    for est in estimators:
        u = np.array(values[("sequence", est)])
        row = {"estimator": est, **{c: metrics.get(("sequence", est, "Accuracy", c)) for c in METRIC_COLS}}
        row["roc_auc_wrong"] = roc_auc(wrong, u)
        rows.append(row)

    # Claim level: answer lines labelled by tasks.label_steps (arithmetic check / final answer).
    claim_rows, n_claims = [], 0
    texts = parsed["greedy_texts"]
    if len(texts) == len(questions):
        lines = [[s.strip() for s in t.split("\n") if s.strip()] for t in texts]
        labels = [tasks.label_steps(ls, bool(a)) for ls, a in zip(lines, acc)]
        flat = [label for ls in labels for label in ls]
        answer_of = np.array([i for i, ls in enumerate(labels) for _ in ls])
        kept_scores: dict[str, np.ndarray] = {}
        for key in [k for k in values if k[0] == "claim"]:
            u = values[key]
            if len(u) != len(flat):
                continue  # claims split differently from text lines; skip rather than misalign
            keep = [i for i, label in enumerate(flat) if label is not None and np.isfinite(u[i])]
            y = np.array([flat[i] for i in keep])
            if 0 < y.sum() < len(y):
                raw, norm = polygraph_prr(y, np.array(u)[keep])
                kept_scores[key[1]] = np.array(u)[keep]
                claim_y, claim_groups = y, answer_of[keep]
                claim_rows.append({"estimator": key[1], "roc_auc_wrong": roc_auc(y, np.array(u)[keep]),
                                   "prr": raw, "prr_normalized": norm, "n_claims": len(y), "wrong_rate": float(y.mean())})
                n_claims = len(y)

    stamp = stamp or {}
    # Head vs the best other claim estimator by ROC-AUC: 95% CI resampling answers (lines of one
    # answer move together), as in the study.
    claim_delta = None
    heads = [r for r in claim_rows if r["estimator"].startswith("UHead")]
    others = [r for r in claim_rows if not r["estimator"].startswith("UHead")]
    if heads and others:
        from uhead_vllm.study.evaluate import bootstrap_delta

        h, b = heads[0], max(others, key=lambda r: r["roc_auc_wrong"])
        lo, hi = bootstrap_delta(claim_y, kept_scores[h["estimator"]], kept_scores[b["estimator"]], claim_groups, 1000)
        claim_delta = {"head": h["estimator"], "best_other": b["estimator"],
                       "delta_roc_auc": h["roc_auc_wrong"] - b["roc_auc_wrong"], "ci95": [lo, hi]}

    result = {
        **stamp, "command": command, "seconds": round(seconds, 1), "n_questions": len(questions),
        "accuracy": float(acc.mean()), "head": str(head_dir), "sequence": rows, "claim": claim_rows, "claim_head_vs_best_other": claim_delta,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")

    def fmt(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}"

    md = [
        "# polygraph_eval: uncertainty head vs baselines (SmolLM2-135M-Instruct, vLLM CPU)",
        "",
        f"{len(questions)} basic_arithmetic questions, greedy answers, accuracy {acc.mean():.1%}; "
        f"head `{head_dir.relative_to(REPO) if head_dir.is_relative_to(REPO) else head_dir}`; "
        f"polygraph_eval wall time {seconds:.0f} s.",
        "",
        *([f"Produced at commit `{stamp['commit']}` by `{stamp['script_command']}`; evaluation questions: "
           f"{stamp['eval_questions']}."] if stamp.get("commit") else []),
        *([f"Report re-made from that run's log at commit `{stamp['report_commit']}` (`--report-only`)."]
          if stamp.get("report_commit") else []),
        "",
        "```", command, "```",
        "",
        "Sequence level, ground truth `Accuracy` (exact final number). Columns from polygraph_eval's "
        "own metrics table; `ROC-AUC` (uncertainty vs wrong answer) computed from the per-sample values in its log.",
        "",
        "| estimator | PRR | PRR norm. | PRR@0.5 | PRR@0.5 norm. | isotonic PCC | ECE | ROC-AUC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(f"| {r['estimator']} | " + " | ".join(fmt(r[c]) for c in METRIC_COLS) + f" | {fmt(r['roc_auc_wrong'])} |")
    if claim_rows:
        from uhead_vllm.heads import load_head

        usage = load_head(head_dir).usage
        level = usage.level if usage is not None else None
        trained_on = "lines of the study's answers" if level == "step" else "whole answers, not lines"
        md += ["", f"Claim level (answer lines; {n_claims} checkable lines labelled by `tasks.label_steps`; "
               f"the head was trained on {trained_on}):", "",
               "PRR and PRR norm. as polygraph_eval defines them (lm-polygraph's `PredictionRejectionArea`).", "",
               "| estimator | ROC-AUC | PRR | PRR norm. |", "|---|---|---|---|"]
        md += [f"| {r['estimator']} | {fmt(r['roc_auc_wrong'])} | {fmt(r['prr'])} | {fmt(r['prr_normalized'])} |"
               for r in claim_rows]
        if claim_delta:
            md += ["", f"ROC-AUC({claim_delta['head']}) - ROC-AUC({claim_delta['best_other']}) = "
                       f"{claim_delta['delta_roc_auc']:+.3f}, 95% CI {claim_delta['ci95'][0]:+.3f} … "
                       f"{claim_delta['ci95'][1]:+.3f} (bootstrap over answers, 1000 resamples)."]
    (out / "results.md").write_text("\n".join(md) + "\n")
    return result


# ---------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-eval", type=int, default=300)
    ap.add_argument("--n-train", type=int, default=300)
    ap.add_argument("--task", default="basic_arithmetic")
    ap.add_argument("--head", default=None, help="saved head dir or 'default' (default: train a linear probe for this set-up)")
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "polygraph")
    ap.add_argument("--report-only", action="store_true",
                    help="re-write results.md/json from the existing run's log (no generation); keeps its stamp")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for polygraph_eval")
    a = ap.parse_args()
    if a.report_only:
        out = a.out.resolve()
        prev = json.loads((out / "results.json").read_text())
        questions = tasks_module().load_questions_jsonl(out / "data" / f"{a.task}_eval.jsonl")
        stamp = {k: prev[k] for k in ("commit", "script_command", "eval_questions") if k in prev}
        stamp["report_commit"] = provenance.commit()
        report(parse_log(out / "run" / "polygraph_eval.log"), questions, out, prev["command"], prev["seconds"],
               Path(prev["head"]), stamp)
        print((out / "results.md").read_text())
        return

    from uhead_vllm import tasks
    from uhead_vllm.polygraph import default_head_dir

    out = a.out.resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)
    script_command = "python experiments/polygraph/run_polygraph.py " + " ".join(
        x.replace(str(REPO) + "/", "") for x in sys.argv[1:])
    commit = provenance.commit()
    if a.head is not None:
        head_dir = default_head_dir() if a.head == "default" else Path(a.head).resolve()
        trained_on = head_training_questions(head_dir)
        if trained_on is None:
            sys.exit(f"{head_dir}: cannot tell which questions the head was trained on; refusing to evaluate "
                     "on questions that might overlap them")
    else:
        trained_on = set()  # the probe is trained below on questions drawn to exclude these
    questions = eval_questions(a.task, a.n_eval, trained_on)
    csv = out / "data" / f"{a.task}_eval.csv"
    tasks.write_polygraph_dataset(csv, questions)
    tasks.save_questions_jsonl(out / "data" / f"{a.task}_eval.jsonl", questions)

    cfg = compose_config(list(a.overrides))
    if a.head is None:
        head_dir = train_head(cfg, a.n_train, a.task, [q.question for q in questions], out)
        trained_on = head_training_questions(head_dir)
        assert trained_on is not None and not trained_on & {q.question for q in questions}
    stamp = {"commit": commit, "script_command": script_command,
             "eval_questions": f"{a.task} seed {EVAL_SEED}, {len(questions)} distinct, disjoint (asserted) "
                               f"from the {len(trained_on)} questions the head was trained on"}

    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # Hydra appends to an existing log: never mix two runs
    overrides = [f"uhead.head_path={head_dir}", f"dataset={csv}", f"hydra.run.dir={run_dir}", *a.overrides]
    # the builder modules polygraph_eval imports by name (estimators/) live at the repository's root
    env = dict(os.environ, HYDRA_CONFIG=str(CONFIG),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [str(Path(sys.executable).parent / "polygraph_eval"), *overrides]
    shown = "HYDRA_CONFIG=$PWD/configs/polygraph/polygraph_eval_arith.yaml polygraph_eval " + " ".join(
        o.replace(str(REPO) + "/", "") for o in overrides)
    print("running:", shown, flush=True)
    t0 = time.time()
    with open(out / "polygraph_eval.out", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.time() - t0
    if proc.returncode != 0:
        sys.exit(f"polygraph_eval failed ({proc.returncode}); see {out / 'polygraph_eval.out'}")
    parsed = parse_log(run_dir / "polygraph_eval.log")
    raw = [f"{k}: {v}" for k, v in parsed["metrics"].items()]
    (out / "polygraph_eval_metrics.txt").write_text("\n".join(raw) + "\n")
    report(parsed, questions, out, shown, seconds, head_dir, stamp)
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
