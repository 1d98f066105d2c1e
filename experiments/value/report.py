"""Tables, paired bootstrap CIs and a plot for the value study (reads the --work files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from uhead_vllm.heads import default_head_dir  # noqa: F401  (re-exported for the runner)
from uhead_vllm.study.value.stats import bootstrap_mean, paired_bootstrap

HEAD = "head_rank"
NOT_BASELINES = {HEAD, "oracle"}


def _load_search(work: Path) -> dict[str, list[dict]]:
    """Per task, one record per seed: the runs of its per-n files merged (greedy is in each)."""
    merged: dict[tuple[str, int], dict] = {}
    for path in sorted((work / "search").glob("*.json")):
        d = json.loads(path.read_text())
        rec = merged.setdefault((d["task"], d["seed"]), {**d, "runs": {}, "wall_s": 0.0})
        if rec["questions"] != d["questions"]:
            raise ValueError(f"{path}: other questions than the seed's other files")
        for run, r in d["runs"].items():
            rec["runs"].setdefault(run, r)
        rec["wall_s"] += d["wall_s"]
    by_task: dict[str, list[dict]] = {}
    for (task, _), rec in sorted(merged.items()):
        by_task.setdefault(task, []).append(rec)
    return by_task


def _per_question(files: list[dict], run: str) -> tuple[np.ndarray, float]:
    """Correctness averaged over seeds per question, and mean tokens per question."""
    corr = np.mean([f["runs"][run]["correct"] for f in files], axis=0)
    tokens = float(np.mean([np.mean(f["runs"][run]["tokens"]) for f in files]))
    return corr, tokens


def _strategies(runs: list[str]) -> list[str]:
    return sorted({r.split("/")[0] for r in runs if "/" in r}, key=lambda s: (s.startswith("beam"), s))


def task_summary(files: list[dict]) -> dict[str, Any]:
    runs = [r for r in files[0]["runs"] if all(r in f["runs"] for f in files)]  # runs every seed has
    rows = {}
    for run in runs:
        corr, tokens = _per_question(files, run)
        rows[run] = {**bootstrap_mean(corr), "tokens_per_question": tokens}
    comparisons = []
    greedy, _ = _per_question(files, "greedy")
    for strat in _strategies(runs):
        head_run = f"{strat}/{HEAD}"
        if head_run not in rows:
            continue
        head, _ = _per_question(files, head_run)
        others = [r for r in runs if r.startswith(strat + "/") and r.split("/")[1] not in NOT_BASELINES]
        # beam 2xk spends 2k candidates per step, as best-of-2k does
        n = strat.split("@")[-1] if "@" in strat else str(2 * int(strat.split("x")[-1])) if "x" in strat else None
        if n is not None and f"majority@{n}" in rows:
            others.append(f"majority@{n}")
        best_other = max(others, key=lambda r: rows[r]["mean"])
        comparisons.append({"run": head_run, "vs": "greedy", **paired_bootstrap(head, greedy)})
        comparisons.append({"run": head_run, "vs": best_other, "note": "best other scorer",
                            **paired_bootstrap(head, _per_question(files, best_other)[0])})
        oracle_run = f"{strat}/oracle"
        if oracle_run in rows:
            comparisons.append({"run": oracle_run, "vs": "greedy", "note": "ceiling of step choice",
                                **paired_bootstrap(_per_question(files, oracle_run)[0], greedy)})
        if n is not None and f"pass@{n}" in rows:
            comparisons.append({"run": f"pass@{n}", "vs": "greedy", "note": "ceiling of answer choice",
                                **paired_bootstrap(_per_question(files, f"pass@{n}")[0], greedy)})
    return {"seeds": [f["seed"] for f in files], "questions": len(files[0]["questions"]), "runs": rows,
            "comparisons": comparisons, "wall_s": sum(f["wall_s"] for f in files)}


def _fmt_ci(r: dict, key: str = "mean") -> str:
    return f"{r[key]:+.3f} ({r['lo']:+.3f} … {r['hi']:+.3f})" if key == "delta" else \
        f"{r[key]:.3f} ({r['lo']:.3f}-{r['hi']:.3f})"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def write(work: Path, results: Path, meta: dict) -> list[Path]:
    results.mkdir(parents=True, exist_ok=True)
    tasks = {t: task_summary(fs) for t, fs in _load_search(work).items()}
    steps_path = work / "step_metrics.json"
    step = json.loads(steps_path.read_text()) if steps_path.is_file() else {}
    collect_path = work / "steps" / "summary.json"
    collect = json.loads(collect_path.read_text()) if collect_path.is_file() else {}
    out = {"meta": meta, "tasks": tasks, "step_metrics": step.get("metrics", {}),
           "ranking_head_search": step.get("search", []), "step_data": collect}
    jpath = results / "value_study.json"
    jpath.write_text(json.dumps(out, indent=2))
    md = ["# Value study: head-scored best-of-n and beam search", "",
          f"Commit `{meta['commit']}`; command `{meta['command']}`; {meta['platform']}.", ""]
    for task, s in tasks.items():
        md += [f"## {task}: {s['questions']} held-out questions x seeds {s['seeds']}", "",
               "| run | accuracy (95% CI) | tokens / question |", "|---|---|---|"]
        for run, r in s["runs"].items():
            md.append(f"| {run} | {_fmt_ci(r)} | {r['tokens_per_question']:.0f} |")
        md += ["", "Paired bootstrap over questions (accuracy difference, 95% CI):", "",
               "| run | vs | difference | note |", "|---|---|---|---|"]
        for c in s["comparisons"]:
            md.append(f"| {c['run']} | {c['vs']} | {_fmt_ci(c, 'delta')} | {c.get('note', '')} |")
        md.append("")
    if out["step_metrics"]:
        md += ["## Step metrics on held-out on-policy candidates", "",
               "Wrong step = label value 0 (no rollout from it reaches the right answer, or a wrong equation).", "",
               "| task | scorer | PR-AUC (wrong) | chance | PR-AUC (right) | chance | ROC-AUC | within-step pairwise |",
               "|---|---|---|---|---|---|---|---|"]
        for task, per in out["step_metrics"].items():
            for name, m in sorted(per.items(), key=lambda kv: -(kv[1]["pr_auc"] or 0.0)):
                cells = [_num(m.get(k)) for k in ("pr_auc", "pr_auc_chance", "pr_auc_right", "pr_auc_right_chance",
                                                  "roc_auc", "within_step_pairwise")]
                md.append(f"| {task} | {name} | " + " | ".join(cells) + " |")
        md.append("")
    if collect:
        md += ["## Step data", "", "```", json.dumps(collect, indent=1), "```", ""]
    mpath = results / "value_study.md"
    mpath.write_text("\n".join(md))
    paths = [jpath, mpath]
    if tasks:
        paths.append(_plot(tasks, results / "value_study.png"))
    return paths


def _plot(tasks: dict, path: Path) -> Path:
    from uhead_vllm.metrics import _figure

    fig, axes = _figure(ncols=len(tasks), figsize=(7 * len(tasks), 6))
    axes = np.asarray(axes).ravel()
    for ax, (task, s) in zip(axes, tasks.items()):
        names = list(s["runs"])
        means = [s["runs"][r]["mean"] for r in names]
        err = [[s["runs"][r]["mean"] - s["runs"][r]["lo"] for r in names],
               [s["runs"][r]["hi"] - s["runs"][r]["mean"] for r in names]]
        colors = ["tab:red" if HEAD in r else "tab:gray" if "oracle" in r or "pass@" in r else "tab:blue" for r in names]
        ax.barh(range(len(names)), means, xerr=err, color=colors)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("accuracy (95% bootstrap CI)")
        ax.set_title(task)
    fig.savefig(path, dpi=110)
    return path
