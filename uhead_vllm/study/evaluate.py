"""Evaluate heads against logprob baselines on the same answers and steps.

For each evaluation set (a dataset directory) and level:
- answer level: every answer with at least one hidden row, label = final grade is wrong;
  heads score an answer with their recorded ``answer_scoring`` (``span`` or ``max_step``), and
  the other rule is reported too;
- step level: every labelled step (unlabelled steps are excluded, but still count for
  ``max_step``).
Metrics: ROC-AUC, PRR (both with wrong = positive, uncertainty = score), ECE for heads (they
output probabilities); a bootstrap CI (resampling answers, so steps of one answer move together)
of ROC-AUC(head) - ROC-AUC(best baseline), the best baseline picked on the same set.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from tqdm.auto import tqdm

from ..features import FeatureRecipe
from ..heads import UncertaintyHead, load_head
from ..metrics import expected_calibration_error, plot_calibration, plot_rejection_curves, prr, roc_auc
from ..scoring.spans import answer_scores
from .baselines import BASELINES
from .data import StudyDataset
from .examples import Examples, check_recipe, load_examples


@dataclass
class SetScores:
    """Labels and uncertainty scores of one evaluation set at one level."""

    labels: np.ndarray
    groups: np.ndarray  # answer index per item, for the cluster bootstrap
    scores: dict[str, np.ndarray]
    probabilistic: set[str]


def _recipe_key(recipe: FeatureRecipe) -> str:
    return json.dumps(recipe.to_dict(), sort_keys=True)


def _recipe(head: UncertaintyHead) -> FeatureRecipe:
    """The head's feature recipe (a head without one cannot read a study set)."""
    assert head.recipe is not None
    return head.recipe


def score_set(ds: StudyDataset, heads: Mapping[str, UncertaintyHead], progress: bool = True) -> dict[str, SetScores]:
    """Scores of all heads and baselines on one dataset, at answer and step level."""
    by_recipe: dict[str, dict[str, Examples]] = {}
    for head in heads.values():
        key = _recipe_key(_recipe(head))
        if key not in by_recipe:
            check_recipe(ds, _recipe(head))
            by_recipe[key] = load_examples([ds], _recipe(head), progress=progress, labelled_only=False)
    any_ex = next(iter(by_recipe.values()))
    answers, steps = any_ex["answer"], any_ex["step"]
    lab = steps.labelled()
    aid_index = {a: i for i, a in enumerate(answers.answer_ids)}
    out = {
        "answer": SetScores(answers.y(), np.arange(len(answers)), {b: answers.baseline(b) for b in BASELINES}, set()),
        "step": SetScores(steps.y()[lab], np.array([aid_index.get(steps.answer_ids[i], -1) for i in lab]),
                          {b: steps.baseline(b)[lab] for b in BASELINES}, set()),
    }
    for name, head in heads.items():
        ex = by_recipe[_recipe_key(_recipe(head))]
        rule = head.require_usage().answer_scoring
        other = "max_step" if rule == "span" else "span"
        step_probs = head.predict_proba(ex["step"].features)  # all steps, once: max_step and step level
        out["answer"].scores[name] = answer_scores(head, ex["answer"], ex["step"], rule, step_probs)
        out["answer"].scores[f"{name} [{other}]"] = answer_scores(head, ex["answer"], ex["step"], other, step_probs)
        out["answer"].probabilistic |= {name, f"{name} [{other}]"}
        out["step"].scores[name] = step_probs[lab]
        out["step"].probabilistic.add(name)
    return out


def bootstrap_delta(y: np.ndarray, a: np.ndarray, b: np.ndarray, groups: np.ndarray,
                    n_boot: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% percentile CI of ROC-AUC(a) - ROC-AUC(b), resampling whole groups (answers)."""
    rng = np.random.default_rng(seed)
    uniq = np.unique(groups)
    members = {g: np.flatnonzero(groups == g) for g in uniq}
    deltas = []
    for _ in range(n_boot):
        pick = np.concatenate([members[g] for g in rng.choice(uniq, size=len(uniq), replace=True)])
        yy = y[pick]
        if yy.min() == yy.max():
            continue
        deltas.append(roc_auc(yy, a[pick]) - roc_auc(yy, b[pick]))
    lo, hi = np.percentile(deltas, [2.5, 97.5])
    return float(lo), float(hi)


def metrics_for(s: SetScores, n_boot: int) -> dict[str, Any]:
    y = s.labels
    res: dict[str, Any] = {"n": int(len(y)), "n_wrong": int(y.sum()), "methods": {}}
    if len(y) == 0 or y.min() == y.max():
        res["note"] = "one class only: ROC-AUC and PRR are undefined"
        return res
    for name, u in s.scores.items():
        m = {"roc_auc": roc_auc(y, u), "prr": prr(y, u)}
        if name in s.probabilistic:
            m["ece"] = expected_calibration_error(y, u)
        res["methods"][name] = m
    best = max(BASELINES, key=lambda b: res["methods"][b]["roc_auc"])
    res["best_baseline"] = best
    res["head_vs_best_baseline"] = {}
    for name in s.scores:
        if name in BASELINES:
            continue
        delta = res["methods"][name]["roc_auc"] - res["methods"][best]["roc_auc"]
        lo, hi = bootstrap_delta(y, s.scores[name], s.scores[best], s.groups, n_boot) if n_boot else (None, None)
        res["head_vs_best_baseline"][name] = {"delta_roc_auc": delta, "ci95": [lo, hi]}
    return res


def plot_set(out_dir: Path, set_name: str, level: str, s: SetScores, calib_head: str | None) -> list[str]:
    y = s.labels
    if len(y) == 0 or y.min() == y.max():
        return []
    files = []
    curves = {name: (y, u) for name, u in s.scores.items() if "[" not in name}
    files.append(plot_rejection_curves(out_dir / f"rejection_{set_name}_{level}.png", curves).name)
    if calib_head is not None and calib_head in s.scores:
        files.append(plot_calibration(out_dir / f"calibration_{set_name}_{level}_{calib_head}.png", y,
                                      s.scores[calib_head]).name)
    return files


def evaluate(head_dirs: Mapping[str, str | Path], eval_dirs: Mapping[str, str | Path], out_dir: str | Path,
             *, calibration_head: str | None = None, n_boot: int = 1000, progress: bool = True,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Score every eval set with every head and the baselines; write results.json/.md and PNGs."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sets = {name: StudyDataset(p) for name, p in eval_dirs.items()}
    identity = next(iter(sets.values())).model_identity
    heads = {name: load_head(p, expect_model_identity=identity) for name, p in head_dirs.items()}
    calibration_head = calibration_head or next(iter(heads))
    if calibration_head not in heads:
        raise ValueError(f"calibration head {calibration_head!r} is not among the heads {sorted(heads)}")
    results: dict[str, Any] = {
        "heads": {name: {"dir": str(p), "type": heads[name].head_type, "recipe": _recipe(heads[name]).to_dict(),
                         "answer_scoring": heads[name].require_usage().answer_scoring,
                         "level": heads[name].require_usage().level}
                  for name, p in head_dirs.items()},
        "sets": {}, "plots": [], "calibration_head": calibration_head,
        **(extra or {}),
    }
    for set_name, ds in tqdm(sets.items(), desc="evaluate", unit="set", disable=not progress):
        scores = score_set(ds, heads, progress)
        results["sets"][set_name] = {"dataset": str(ds.path), "tasks": ds.manifest["tasks"],
                                     "accuracy": ds.manifest["counts"]["total"]["correct"] / max(len(ds), 1)}
        for level, s in scores.items():
            results["sets"][set_name][level] = metrics_for(s, n_boot)
            results["plots"] += plot_set(out, set_name, level, s, calibration_head)
    results["evaluate_seconds"] = round(time.perf_counter() - t0, 1)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(results_markdown(results))
    return results


def _fmt(x: Any) -> str:
    return "–" if x is None else f"{x:.3f}"


def results_markdown(results: Mapping[str, Any]) -> str:
    """Markdown tables: one per evaluation set and level, methods sorted by ROC-AUC."""
    lines = ["# Uncertainty study results", ""]
    for name, h in results["heads"].items():
        lines.append(f"- head `{name}`: {h['type']} trained at {h['level']} level, layers {h['recipe']['layers']}, "
                     f"pooling {h['recipe']['pooling']}, top-{h['recipe']['logprob_topk']} logprobs, "
                     f"answer scoring `{h['answer_scoring']}`")
    lines.append("")
    for set_name, res in results["sets"].items():
        tasks = ", ".join(f"{t['task']} (seed {t['seed']}, {t['selected']} q.)" for t in res["tasks"])
        for level in ("answer", "step"):
            r = res[level]
            lines += [f"## {set_name} — {level} level", "",
                      f"{tasks}; {r['n']} {level}s, {r['n_wrong']} wrong. Uncertainty = P(wrong) for heads.", ""]
            if "note" in r:
                lines += [r["note"], ""]
                continue
            lines += ["| method | ROC-AUC | PRR | ECE |", "|---|---|---|---|"]
            for m, v in sorted(r["methods"].items(), key=lambda kv: -kv[1]["roc_auc"]):
                label = f"{m} (best baseline)" if m == r["best_baseline"] else m
                lines.append(f"| {label} | {v['roc_auc']:.3f} | {v['prr']:.3f} | {_fmt(v.get('ece'))} |")
            lines.append("")
            for m, d in r["head_vs_best_baseline"].items():
                lo, hi = d["ci95"]
                ci = f" (95% CI {lo:+.3f} … {hi:+.3f})" if lo is not None else ""
                lines.append(f"- {m} − {r['best_baseline']}: ROC-AUC {d['delta_roc_auc']:+.3f}{ci}")
            lines.append("")
    return "\n".join(lines) + "\n"
