"""A dataset being written, one work unit at a time, so that any number of writers (one process,
or Ray actors on a shared filesystem) can fill it and an interrupted run can resume.

``<out>.partial/`` holds ``job.json`` (what is being collected, to refuse resuming another job)
and, per finished unit ``k``, ``shard-0000k.safetensors`` (tensors) and ``shard-0000k.jsonl`` (its
answers). Each file is written under a temporary name and renamed, the ``.jsonl`` last: a unit is
finished exactly when its ``.jsonl`` exists, and a unit redone (its writer died) replaces both
files. :meth:`PartialDataset.finish` numbers the answers in unit order, writes ``answers.jsonl``
and ``manifest.json`` and renames the folder to ``out`` (see :mod:`.data` for the format).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file

from ..scoring.spans import AnswerArrays
from .data import ANSWERS_FILE, FORMAT, FORMAT_VERSION, MANIFEST_FILE, AnswerRecord, DatasetError, counts

JOB_FILE = "job.json"


def shard_name(unit: int) -> str:
    return f"shard-{unit:05d}.safetensors"


def _records_name(unit: int) -> str:
    return f"shard-{unit:05d}.jsonl"


def _replace_atomically(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


class PartialDataset:
    """The ``.partial`` folder of dataset ``out`` for the job described by ``job`` (JSON)."""

    def __init__(self, out: str | Path, job: dict[str, Any]):
        self.out = Path(out)
        self.dir = self.out.with_name(self.out.name + ".partial")
        self.job = job

    def open(self, *, overwrite: bool = False, resume: bool = True) -> list[int]:
        """Create the folder (or reopen it to resume the same job); returns the finished units.

        A finished dataset at ``out`` needs ``overwrite``; a partial folder of a *different* job
        is refused unless ``overwrite`` (then discarded), never mixed in."""
        if self.out.exists() and not overwrite:
            raise FileExistsError(f"{self.out} exists; pass overwrite=True (--overwrite) to replace it")
        job_file = self.dir / JOB_FILE
        if self.dir.exists() and resume and job_file.is_file():
            if json.loads(job_file.read_text()) == self.job:
                return self.finished()
            if not overwrite:
                raise FileExistsError(f"{self.dir} holds an interrupted run of another collection (other "
                                      "questions, model, layers or recipe); pass overwrite=True (--overwrite) "
                                      "to discard it")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        _replace_atomically(job_file, lambda p: p.write_text(json.dumps(self.job, sort_keys=True)))
        return []

    def finished(self) -> list[int]:
        """Units whose answers file exists (their tensors were renamed into place before it)."""
        return sorted(int(p.name[6:11]) for p in self.dir.glob("shard-*.jsonl"))

    def write_unit(self, unit: int, answers: Sequence[tuple[AnswerRecord, AnswerArrays]]) -> None:
        """Store one unit's answers: tensors first, then the answers file that marks it finished."""
        tensors: dict[str, torch.Tensor] = {}
        lines = []
        for key, (record, arrays) in enumerate(answers):
            t = arrays.token_ids.shape[0]
            if arrays.token_logprobs.shape != (t,) or arrays.topk_logprobs.dim() != 2 or arrays.topk_logprobs.shape[0] != t:
                raise ValueError("token_logprobs must be [T] and topk_logprobs [T, k] for T generated tokens")
            if arrays.hidden.dim() != 3 or arrays.hidden.shape[0] != record.n_rows:
                raise ValueError(f"hidden must be [n_rows={record.n_rows}, L, H], got {tuple(arrays.hidden.shape)}")
            record.shard, record.extra["shard_key"] = shard_name(unit), str(key)
            tensors[f"{key}.hidden"] = arrays.hidden.contiguous()
            tensors[f"{key}.token_ids"] = arrays.token_ids.to(torch.int64).contiguous()
            tensors[f"{key}.token_logprobs"] = arrays.token_logprobs.to(torch.float32).contiguous()
            tensors[f"{key}.topk_logprobs"] = arrays.topk_logprobs.to(torch.float32).contiguous()
            lines.append(record.to_json())
        meta = {"format": FORMAT, "answers": str(len(lines))}
        _replace_atomically(self.dir / shard_name(unit), lambda p: save_file(tensors, str(p), metadata=meta))
        _replace_atomically(self.dir / _records_name(unit),
                            lambda p: p.write_text("".join(line + "\n" for line in lines), encoding="utf-8"))

    def finish(self, n_units: int, manifest: dict[str, Any]) -> Path:
        """Join units ``0..n_units-1`` into ``answers.jsonl`` + ``manifest.json``; move into place."""
        missing = sorted(set(range(n_units)) - set(self.finished()))
        if missing:
            raise DatasetError(f"{self.dir}: units {missing} are not finished")
        records: list[AnswerRecord] = []
        files: dict[str, int] = {}
        for unit in range(n_units):
            for line in (self.dir / _records_name(unit)).read_text(encoding="utf-8").splitlines():
                record = AnswerRecord.from_dict(json.loads(line))
                record.index = len(records)
                records.append(record)
            files[shard_name(unit)] = (self.dir / shard_name(unit)).stat().st_size
        with open(self.dir / ANSWERS_FILE, "w", encoding="utf-8") as f:
            for r in records:
                f.write(r.to_json() + "\n")
        files[ANSWERS_FILE] = (self.dir / ANSWERS_FILE).stat().st_size
        full = {"format": FORMAT, "format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **manifest, "counts": counts(records), "files": dict(sorted(files.items()))}
        (self.dir / MANIFEST_FILE).write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")
        # Only the dataset's own files stay: unit markers, the job file, leftovers of killed writers.
        for extra in [p for p in self.dir.iterdir() if p.name not in files and p.name != MANIFEST_FILE]:
            extra.unlink()
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.dir, self.out)
        return self.out
