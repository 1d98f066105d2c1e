"""Which captured layers carry the uncertainty signal? Cross-validated linear probes per layer.

Usage: python experiments/study/layer_scan.py DATASET_DIR [--out scan.json]
(DATASET_DIR from `python -m uhead_vllm.study collect ... --layers 2 4 ... 30`). Folds are
grouped by answer, so the steps of one answer never sit on both sides of a split.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from sklearn.model_selection import GroupKFold

from uhead_vllm.features import FeatureRecipe
from uhead_vllm.heads import LinearProbeHead
from uhead_vllm.metrics import roc_auc
from uhead_vllm.study.data import StudyDataset
from uhead_vllm.study.examples import load_examples


def cv_auc(features: list[torch.Tensor], y: np.ndarray, groups: list[str], C: float, folds: int = 5) -> float:
    """Pooled out-of-fold ROC-AUC of a linear probe."""
    scores = np.zeros(len(y))
    for train, test in GroupKFold(folds).split(np.zeros(len(y)), y, groups):
        head = LinearProbeHead(C=C).fit([features[i] for i in train], y[train])
        scores[test] = head.predict_proba([features[i] for i in test])
    return roc_auc(y, scores)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dataset")
    ap.add_argument("--out", default=None)
    ap.add_argument("--C", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tasks", nargs="*", default=["basic_arithmetic", "chain_sum"],
                    help="tasks to scan on (keep the study's held-out task out of design choices)")
    ap.add_argument("--combos", nargs="*", default=["8,16,24", "8,12,16,20", "6,12,18,24", "4,10,16,22,28"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ds = StudyDataset(args.dataset)
    every = load_examples([ds], FeatureRecipe(ds.layers), progress=True)
    every = {lv: ex.subset([i for i, t in enumerate(ex.tasks) if t in args.tasks]) for lv, ex in every.items()}
    hidden = ds.manifest["hidden_size"]
    results: dict[str, dict[str, float]] = {}
    candidates = [[k] for k in ds.layers] + [[int(x) for x in c.split(",")] for c in args.combos]
    for layers in candidates:
        if any(k not in ds.layers for k in layers):
            continue
        cols = torch.cat([torch.arange(ds.layers.index(k) * hidden, (ds.layers.index(k) + 1) * hidden) for k in layers])
        row = {}
        for level, ex in every.items():
            feats = [f[:, cols] for f in ex.features]
            row[level] = cv_auc(feats, ex.y(), ex.answer_ids, args.C)
        results[",".join(map(str, layers))] = row
        print(f"layers {layers}: " + "  ".join(f"{k} ROC-AUC {v:.3f}" for k, v in row.items()), flush=True)
    for level, ex in every.items():
        y = ex.y()
        base = {b: round(roc_auc(y, ex.baseline(b)), 3) for b in ex.baselines}
        print(f"{level}: n={len(y)} wrong={int(y.sum())} baselines {base}")
        results[f"baselines_{level}"] = base
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
