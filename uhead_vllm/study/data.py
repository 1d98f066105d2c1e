"""On-disk study dataset: generated answers with their labels, hidden rows and logprobs.

Layout of a dataset directory (everything safe to load: JSON and safetensors, never pickle)::

    manifest.json          model identity, layers, recipe, tasks/seeds, counts, file list
    answers.jsonl          one JSON object per answer (text, grade, steps + labels, baselines)
    shard-00000.safetensors ...

A shard holds, per answer ``i`` of that shard, the tensors ``"{i}.hidden"`` (``[rows, L, H]``
bf16: the captured rows of the *generated* tokens only, row ``r`` = state after reading generated
token ``r``; the last sampled token has no row), ``"{i}.token_ids"`` (int64 ``[T]``),
``"{i}.token_logprobs"`` (float32 ``[T]``, logprob of each sampled token) and
``"{i}.topk_logprobs"`` (float32 ``[T, k]``, best first).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from safetensors import safe_open

from ..errors import DatasetError
from ..scoring.spans import AnswerArrays

FORMAT = "uhead_vllm.study.dataset"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
ANSWERS_FILE = "answers.jsonl"
TENSOR_KEYS = ("hidden", "token_ids", "token_logprobs", "topk_logprobs")


@dataclass
class StepRecordJson:
    """One step of an answer: token span relative to the first generated token, text, label."""

    start: int
    end: int
    text: str
    label: int | None  # 1 wrong, 0 right, None uncheckable


@dataclass
class AnswerRecord:
    """Everything about one generated answer except its tensors."""

    index: int
    qid: str
    task: str
    question: str
    reference: str
    text: str
    extracted: str | None
    correct: bool
    score: float
    finish_reason: str | None
    n_tokens: int
    n_rows: int
    prompt_tokens: int
    shard: str
    steps: list[StepRecordJson]
    baselines: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def wrong(self) -> int:
        return int(not self.correct)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AnswerRecord":
        d = dict(d)
        d["steps"] = [StepRecordJson(**s) for s in d["steps"]]
        return cls(**d)


def counts(records: list[AnswerRecord]) -> dict[str, Any]:
    """Answer and step label counts, overall and per task."""

    def one(rs: list[AnswerRecord]) -> dict[str, int]:
        steps = [s for r in rs for s in r.steps]
        return {
            "answers": len(rs),
            "correct": sum(r.correct for r in rs),
            "wrong": sum(not r.correct for r in rs),
            "truncated": sum(r.finish_reason == "length" for r in rs),
            "tokens": sum(r.n_tokens for r in rs),
            "steps": len(steps),
            "steps_right": sum(s.label == 0 for s in steps),
            "steps_wrong": sum(s.label == 1 for s in steps),
            "steps_unlabelled": sum(s.label is None for s in steps),
        }

    tasks = sorted({r.task for r in records})
    return {"total": one(records), "per_task": {t: one([r for r in records if r.task == t]) for t in tasks}}


class StudyDataset:
    """Read-only view of a dataset directory; tensors are read lazily, shard by shard."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            hint = " (an interrupted collect left a .partial folder)" if self.path.with_name(self.path.name + ".partial").exists() else ""
            raise DatasetError(f"dataset directory {self.path} does not exist{hint}; run `collect` first")
        mpath = self.path / MANIFEST_FILE
        if not mpath.is_file():
            raise DatasetError(f"{self.path} has no {MANIFEST_FILE}: not a study dataset (or incomplete)")
        self.manifest: dict[str, Any] = json.loads(mpath.read_text())
        if self.manifest.get("format") != FORMAT:
            raise DatasetError(f"{mpath}: format is {self.manifest.get('format')!r}, expected {FORMAT!r}")
        if int(self.manifest.get("format_version", 0)) > FORMAT_VERSION:
            raise DatasetError(f"{mpath}: format_version {self.manifest['format_version']} is newer than {FORMAT_VERSION}")
        for name, size in self.manifest.get("files", {}).items():
            f = self.path / name
            if not f.is_file() or f.stat().st_size != size:
                raise DatasetError(f"{f} is missing or has the wrong size (manifest says {size} bytes)")
        with open(self.path / ANSWERS_FILE, encoding="utf-8") as fh:
            self.answers = [AnswerRecord.from_dict(json.loads(line)) for line in fh if line.strip()]
        if len(self.answers) != self.manifest["counts"]["total"]["answers"]:
            raise DatasetError(f"{self.path}: answers.jsonl has {len(self.answers)} answers, manifest says "
                               f"{self.manifest['counts']['total']['answers']}")

    @property
    def layers(self) -> list[int]:
        return list(self.manifest["layers"])

    @property
    def model_identity(self) -> dict[str, Any]:
        return dict(self.manifest["model_identity"])

    @property
    def name(self) -> str:
        return self.path.name

    def __len__(self) -> int:
        return len(self.answers)

    def arrays(self, index: int) -> AnswerArrays:
        """Tensors of answer ``index`` (opens its shard)."""
        rec = self.answers[index]
        with safe_open(str(self.path / rec.shard), framework="pt") as f:
            return self._read(f, rec)

    @staticmethod
    def _read(f: Any, rec: AnswerRecord) -> AnswerArrays:
        key = rec.extra["shard_key"]
        return AnswerArrays(*(f.get_tensor(f"{key}.{name}") for name in TENSOR_KEYS))

    def iter_arrays(self) -> Iterator[tuple[AnswerRecord, AnswerArrays]]:
        """All answers in order, each shard opened once."""
        by_shard: dict[str, list[AnswerRecord]] = {}
        for r in self.answers:
            by_shard.setdefault(r.shard, []).append(r)
        for shard, recs in by_shard.items():
            with safe_open(str(self.path / shard), framework="pt") as f:
                for r in recs:
                    yield r, self._read(f, r)


def compare_datasets(a: str | Path, b: str | Path) -> dict[str, Any]:
    """Are two datasets the same data (e.g. one collected on one replica, one on several)?

    Same file names, ``answers.jsonl`` byte for byte, every shard tensor bit for bit and manifests
    equal but for ``created``. Shard *bytes* are not compared: safetensors writes its header
    metadata from a hash map, so equal shards can differ in byte order. ``max_abs_diff`` is the
    largest difference of differing float tensors of equal shape (0.0 when none differ).
    """
    import torch

    a, b = Path(a), Path(b)
    names = sorted(p.name for p in a.iterdir())
    same_names = names == sorted(p.name for p in b.iterdir())
    ma, mb = (json.loads((d / MANIFEST_FILE).read_text()) for d in (a, b))
    ma.pop("created", None), mb.pop("created", None)
    answers = (a / "answers.jsonl").read_bytes() == (b / "answers.jsonl").read_bytes()
    differing, worst = 0, 0.0
    for name in names:
        if not (name.endswith(".safetensors") and (b / name).is_file()):
            continue
        with safe_open(str(a / name), "pt") as fa, safe_open(str(b / name), "pt") as fb:
            keys = set(fa.keys())
            differing += len(keys ^ set(fb.keys()))
            for key in keys & set(fb.keys()):
                x, y = fa.get_tensor(key), fb.get_tensor(key)
                if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                    differing += 1
                    if x.shape == y.shape and x.is_floating_point() and y.is_floating_point():
                        worst = max(worst, float((x.float() - y.float()).abs().max()))
    return {"same_files": same_names, "manifests_equal": ma == mb, "answers_identical": answers,
            "tensors_differing": differing, "max_abs_diff": worst,
            "identical": same_names and ma == mb and answers and differing == 0}
