"""On-policy step data: the candidates best-of-n has to choose between, labelled, with features.

For each question a random walk down the step tree (the path best-of-n with random choice
would take): every node on it is expanded into ``n`` candidates exactly as the search samples
them (same prompt, temperature, step stop), every candidate is labelled (:mod:`.labels`) and
keeps its pooled head features and every baseline's validity. Siblings share a ``group`` id,
which is what the ranking head and the within-step metric need.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .labels import label_candidates
from .tree import Candidate, Expander, Node, stable_seed


@dataclass
class StepData:
    """Labelled sibling candidates: one row per candidate."""

    features: torch.Tensor  # [N, D] pooled head features
    values: np.ndarray  # [N] label value in [0, 1]; 0 = wrong step
    groups: np.ndarray  # [N] sibling group (one node)
    questions: np.ndarray  # [N] question index
    depths: np.ndarray  # [N] step index (0 = first line)
    validity: dict[str, np.ndarray] = field(default_factory=dict)  # scorer -> [N]
    texts: list[str] = field(default_factory=list)

    @property
    def wrong(self) -> np.ndarray:
        return (self.values == 0).astype(np.int64)

    def subset(self, mask: np.ndarray) -> "StepData":
        idx = np.flatnonzero(mask)
        return StepData(self.features[torch.from_numpy(idx)], self.values[idx], self.groups[idx],
                        self.questions[idx], self.depths[idx], {k: v[idx] for k, v in self.validity.items()},
                        [self.texts[i] for i in idx])

    def save(self, path: str | Path) -> None:
        """``<path>.safetensors`` (arrays) + ``<path>.json`` (texts, scorer names); no pickle."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"features": self.features.contiguous(),
                   "values": torch.from_numpy(self.values.astype(np.float64)),
                   "groups": torch.from_numpy(self.groups.astype(np.int64)),
                   "questions": torch.from_numpy(self.questions.astype(np.int64)),
                   "depths": torch.from_numpy(self.depths.astype(np.int64))}
        tensors.update({f"validity.{k}": torch.from_numpy(v.astype(np.float64)) for k, v in self.validity.items()})
        save_file(tensors, str(_file(path, ".safetensors")))
        _file(path, ".json").write_text(json.dumps({"texts": self.texts, "scorers": sorted(self.validity)}))

    @classmethod
    def load(cls, path: str | Path) -> "StepData":
        path = Path(path)
        t = load_file(str(_file(path, ".safetensors")))
        meta = json.loads(_file(path, ".json").read_text())
        return cls(t["features"], t["values"].numpy(), t["groups"].numpy(), t["questions"].numpy(),
                   t["depths"].numpy(), {k: t[f"validity.{k}"].numpy() for k in meta["scorers"]}, meta["texts"])


def _file(stem: Path, ext: str) -> Path:
    return stem.parent / (stem.name + ext)  # not with_suffix: stems hold dots ("task.split")


def collect_steps(expander: Expander, *, n: int, max_steps: int, rollouts: int, rollout_tokens: int,
                  progress: Callable[[str], Any] | None = None) -> tuple[StepData, dict[str, int]]:
    """Random walk per question; every node's ``n`` candidates labelled. Returns data and token counts."""
    if expander.feature_head is None:
        raise ValueError("collect_steps needs an Expander with a feature_head (the features to keep)")
    say = progress or (lambda _m: None)
    nodes = [Node(q) for q in range(len(expander.questions))]
    rows: list[tuple[Candidate, int, int, int]] = []
    rollout_tokens_used = 0
    group = 0
    for depth in range(max_steps):
        if not nodes:
            break
        say(f"step data, line {depth + 1}: {len(nodes)} nodes x {n} candidates")
        kids = expander.expand(nodes, n)
        rollout_tokens_used += label_candidates(expander, list(zip(nodes, kids)), k=rollouts, max_tokens=rollout_tokens)
        nxt = []
        for nd, cands in zip(nodes, kids):
            for c in cands:
                rows.append((c, group, nd.q, depth))
            group += 1
            pick = cands[stable_seed("walk", expander.seed, nd.q, nd.prefix) % len(cands)]
            if not pick.finished:
                nxt.append(Node(nd.q, nd.prefix + pick.text))
        nodes = nxt
    names = sorted(rows[0][0].validity) if rows else []
    data = StepData(
        torch.stack([c.features for c, *_ in rows]) if rows else torch.zeros(0, 0),
        np.array([c.value for c, *_ in rows], dtype=np.float64),
        np.array([g for _, g, _, _ in rows], dtype=np.int64),
        np.array([q for *_, q, _ in rows], dtype=np.int64),
        np.array([d for *_, d in rows], dtype=np.int64),
        {k: np.array([c.validity[k] for c, *_ in rows], dtype=np.float64) for k in names},
        [c.text for c, *_ in rows])
    return data, {"rollout_tokens": rollout_tokens_used}


def question_split(data: StepData, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Masks (train, validation) splitting by question, so siblings never straddle the split."""
    qs = np.unique(data.questions)
    rng = np.random.default_rng(seed)
    val = set(rng.choice(qs, size=max(1, int(round(fraction * len(qs)))), replace=False).tolist())
    mask = np.array([q in val for q in data.questions])
    return ~mask, mask


def labels_summary(data: StepData) -> dict[str, float]:
    """How many candidates, groups, wrong steps and groups where choosing can matter."""
    diff = 0
    for g in np.unique(data.groups):
        v = data.values[data.groups == g]
        diff += int(v.max() != v.min())
    return {"candidates": int(len(data.values)), "groups": int(len(np.unique(data.groups))),
            "wrong_share": float(data.wrong.mean()) if len(data.values) else 0.0,
            "groups_with_a_choice": diff, "mean_value": float(data.values.mean()) if len(data.values) else 0.0}
