"""Summaries, paired comparisons and the markdown/JSON report of the thinkbooster study."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# (run, baseline) pairs compared question by question when both were run.
COMPARISONS = (("bon_head", "greedy"), ("bon_head", "bon_entropy"), ("bon_head", "bon_random"),
               ("beam_head", "greedy"), ("beam_head", "bon_head"))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        raise ValueError("no questions")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return c - h, c + h


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact binomial (McNemar) p-value on the discordant questions (``scipy.stats.binomtest``)."""
    from scipy.stats import binomtest

    n = wins + losses
    if n == 0:
        return 1.0
    return float(binomtest(wins, n, 0.5, alternative="two-sided").pvalue)


def candidate_diagnostics(records: list[dict]) -> dict[str, Any]:
    """How the scorer ranked the candidates it chose from: ROC-AUC of (1 - validity) for "step is
    wrong" on candidates whose arithmetic is checkable, and mean validity by kind of candidate."""
    from uhead_vllm.metrics import roc_auc
    from uhead_vllm.tasks import check_step_line

    ys, us, unchecked = [], [], []
    for rec in records:
        for step in rec.get("candidates", []):
            for c in step:
                ok = check_step_line(c["text"])
                if ok is None:
                    unchecked.append(c["score"])
                else:
                    ys.append(int(not ok))
                    us.append(1.0 - c["score"])
    n = len(ys) + len(unchecked)
    out: dict[str, Any] = {"candidates": n, "checkable": len(ys), "checkable_wrong": int(sum(ys))}
    if 0 < sum(ys) < len(ys):
        out["auc_checkable"] = float(roc_auc(ys, us))
    if ys:
        right = [1 - u for u, y in zip(us, ys) if y == 0]
        wrong = [1 - u for u, y in zip(us, ys) if y == 1]
        out["mean_validity_right"] = sum(right) / len(right) if right else None
        out["mean_validity_wrong"] = sum(wrong) / len(wrong) if wrong else None
    out["mean_validity_uncheckable"] = sum(unchecked) / len(unchecked) if unchecked else None
    return out


def summarize(runs: list[dict]) -> dict[str, Any]:
    """Per-run accuracy (with CI), token budget, time; paired comparisons between named runs."""
    per_run = {}
    for r in runs:
        recs = r["records"]
        n, k = len(recs), sum(x["correct"] for x in recs)
        lo, hi = wilson(k, n)
        per_run[r["name"]] = {
            "label": r["config"].get("label", r["name"]),
            "strategy": r["config"]["strategy"], "scorer": r["config"]["scorer"],
            "candidates_per_step": r["config"].get("candidates_per_step",
                                                   r["config"].get("beam_size", 1) * r["config"].get("candidates_per_beam", 1)),
            "temperature": r["config"]["temperature"],
            "n": n, "correct": k, "accuracy": k / n, "ci95": [lo, hi],
            "tokens_generated_per_q": sum(x["tokens_generated"] for x in recs) / n,
            "trajectory_tokens_per_q": sum(x["trajectory_tokens"] for x in recs) / n,
            "steps_per_q": sum(x["steps"] for x in recs) / n,
            "wall_s": r["wall_s"], "generate_s": r["generate_s"], "score_s": r["score_s"],
            "score_calls": r["score_calls"], "capture": r["capture"],
            "candidates": candidate_diagnostics(recs) if r["config"].get("candidates_per_step", 2) > 1 else None,
        }
    by_name = {r["name"]: {x["qid"]: x["correct"] for x in r["records"]} for r in runs}
    paired = []
    for a, b in COMPARISONS:
        if a not in by_name or b not in by_name:
            continue
        qa, qb = by_name[a], by_name[b]
        wins = sum(qa[q] and not qb[q] for q in qa)
        losses = sum(qb[q] and not qa[q] for q in qa)
        paired.append({"run": a, "baseline": b, "delta": (sum(qa.values()) - sum(qb.values())) / len(qa),
                       "wins": wins, "losses": losses, "p_value": sign_test_p(wins, losses)})
    return {"runs": per_run, "paired": paired}


def markdown(meta: dict, summary: dict) -> str:
    cfg = meta["config"]
    lines = [
        f"# thinkbooster study: {cfg['task']}, {summary_n(summary)} held-out questions",
        "",
        f"Model `{meta['model_identity']['name']}`, head `{meta['head_dir']}` "
        f"({meta['head']['type']}, layers {meta['head']['recipe']['layers']}, "
        f"pooling {meta['head']['recipe']['pooling']}); questions `load_questions({cfg['task']!r}, "
        f"{cfg['n_questions']}, seed={cfg['question_seed']})` minus the head's "
        f"{meta['heldout']['excluded_training_questions']} training questions, prompt style `{meta['prompt_style']}`, "
        f"one step = one line, at most {cfg['generation']['max_steps']} steps.",
        "",
        f"Command: `{meta['command'].strip()}`",
        "",
        "| run | strategy | step scorer | candidates / step | T | accuracy (95% CI) | tokens generated / q "
        "| final answer tokens / q | steps / q | wall s | scoring s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary["runs"].items():
        lines.append(
            f"| {name} | {s['strategy']} | {s['scorer']} | {s['candidates_per_step']} | {s['temperature']} "
            f"| **{s['accuracy']:.3f}** ({s['ci95'][0]:.3f}-{s['ci95'][1]:.3f}) "
            f"| {s['tokens_generated_per_q']:.1f} | {s['trajectory_tokens_per_q']:.1f} | {s['steps_per_q']:.2f} "
            f"| {s['wall_s']:.0f} | {s['score_s']:.1f} |")
    if summary["paired"]:
        lines += ["", "Paired on the same questions (wins = right only with the run, losses = right only "
                  "with the baseline; exact sign test):", "",
                  "| run | vs | accuracy delta | wins | losses | p |", "|---|---|---|---|---|---|"]
        for p in summary["paired"]:
            lines.append(f"| {p['run']} | {p['baseline']} | {p['delta']:+.3f} | {p['wins']} | {p['losses']} "
                         f"| {p['p_value']:.3g} |")
    diag = [(n, s["candidates"]) for n, s in summary["runs"].items() if s.get("candidates")]
    if diag:
        lines += ["", "How each scorer ranked its candidate steps (checkable = a line with an arithmetic "
                  "equation, `tasks.check_step_line`; the rest is prose or copied text):", "",
                  "| run | candidates | checkable (wrong) | AUC, checkable | mean validity: right / wrong / uncheckable |",
                  "|---|---|---|---|---|"]
        for n, d in diag:
            auc = f"{d['auc_checkable']:.3f}" if "auc_checkable" in d else "n/a"
            mv = " / ".join("n/a" if d.get(k) is None else f"{d[k]:.2f}" for k in
                            ("mean_validity_right", "mean_validity_wrong", "mean_validity_uncheckable"))
            lines.append(f"| {n} | {d['candidates']} | {d['checkable']} ({d['checkable_wrong']}) | {auc} | {mv} |")
    lines += ["", "tokens generated = every candidate's tokens (thinkbooster's per-question output_tokens, "
              "answer phase included); final answer tokens = the chosen trajectory, re-tokenized.",
              f"Engine load {meta['engine_load_s']:.0f} s; {meta['platform']}, {meta['cpu_count']} CPUs."]
    return "\n".join(lines) + "\n"


def summary_n(summary: dict) -> int:
    return next(iter(summary["runs"].values()))["n"] if summary["runs"] else 0


def write_report(out_dir: Path, name: str, meta: dict, runs: list[dict], summary: dict) -> dict[str, Path]:
    """``<name>.json`` (config + summary), ``<name>.md`` (tables), ``<name>_questions.jsonl`` (per question)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md",
             "questions": out_dir / f"{name}_questions.jsonl"}
    paths["json"].write_text(json.dumps({"meta": meta, "summary": summary}, indent=2) + "\n")
    paths["md"].write_text(markdown(meta, summary))
    with open(paths["questions"], "w", encoding="utf-8") as f:
        for r in runs:
            for x in r["records"]:
                f.write(json.dumps({"run": r["name"], **x}, ensure_ascii=False) + "\n")
    return paths
