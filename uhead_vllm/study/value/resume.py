"""Step-level resume: the shared step tree of one (task, seed[, shard]) kept on disk as it grows.

A GPU call is cut at 10 minutes and one best-of-8 part can take longer, so the tree is saved
(gzip JSON, atomically: tmp file + replace) after every step that generated or labelled anything
and after every greedy finish. A new process loads it into its :class:`~.tree.Expander` as
*pending* children: a step whose nodes are in the file replays them without generating, and a cut
loses at most the step that was running.

Saved per expanded (node, n): each candidate's text, token ids, ``finished``, validity per scorer,
oracle label ``value`` and the rollout tokens spent on that label, plus who was charged for the
candidates and for the labels (the ``owner`` of the unit part that made them; see
:meth:`Expander.expand`); and the greedy finishes (text, tokens). Pooled ``features`` are *not*
saved: only the step-data stage (``steps.collect_steps``, which keeps no file) reads them, the
search never does, so :class:`~.search.TreeSearch` refuses a store on an expander with a
``feature_head``. The store reads and writes the expander and the search's finishes it is handed;
it knows nothing of the search itself (the search imports it, not the other way round).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from .tree import Candidate, Expander, Node

VERSION = 1


class TreeStore:
    """One tree file. ``save_s`` / ``size`` describe the last save (for the logs and the docs)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.save_s = 0.0
        self.size = 0

    @staticmethod
    def meta(ex: Expander, search: dict[str, int]) -> dict[str, Any]:
        """Everything the saved children and labels depend on: a file made otherwise is refused.
        ``search``: the search's settings the labels and finishes depend on (``finish_tokens``,
        ``rollouts``, ``rollout_tokens``)."""
        prompts = hashlib.sha256("\x1e".join(ex._chat_text).encode()).hexdigest()
        return {"prompts": prompts, "questions": len(ex.questions), "seed": ex.seed,
                "temperature": ex.temperature, "max_step_tokens": ex.max_step_tokens, "logprobs": ex.logprobs,
                "heads": sorted(ex.heads), **search}

    def load(self, ex: Expander, search: dict[str, int], finished: dict[Node, str],
             finish_cost: dict[Node, int]) -> int:
        """Put the file's children into ``ex.pending`` and its greedy finishes (text, tokens) into
        ``finished`` and ``finish_cost``; returns the number of (node, n) entries (0 when there is
        no file)."""
        if not self.path.is_file():
            return 0
        with gzip.open(self.path, "rt", encoding="utf-8") as f:
            data = json.load(f)
        want = self.meta(ex, search)
        if data.get("version") != VERSION or data.get("meta") != want:
            raise ValueError(f"{self.path} was made with other settings ({data.get('meta')} vs {want}): "
                             "remove it (or run with --overwrite)")
        names = data["validity"]
        for q, prefix, n, made, labelled, cands in data["nodes"]:
            key = (Node(q, prefix), n)
            if key in ex.children:
                continue
            ex.pending[key] = [Candidate(text, tuple(ids), bool(done), dict(zip(names, val)), value=value,
                                         rollout_tokens=rt) for text, ids, done, val, value, rt in cands]
            ex.origin[key] = (made, labelled)
        for q, prefix, text, cost in data["finished"]:
            finished.setdefault(Node(q, prefix), text)
            finish_cost.setdefault(Node(q, prefix), cost)
        return len(data["nodes"])

    def save(self, ex: Expander, search: dict[str, int], finished: dict[Node, str],
             finish_cost: dict[Node, int]) -> None:
        """Rewrite the whole file (children asked for and still pending alike) atomically."""
        start = time.perf_counter()
        entries = [*ex.children.items(), *ex.pending.items()]
        names = sorted(entries[0][1][0].validity) if entries and entries[0][1] else []
        nodes = [[nd.q, nd.prefix, n, *ex.origin.get((nd, n), ("", None)),
                  [[c.text, list(c.token_ids), int(c.finished), [c.validity[k] for k in names], c.value,
                    c.rollout_tokens] for c in cands]]
                 for (nd, n), cands in entries]
        finishes = [[nd.q, nd.prefix, text, finish_cost[nd]] for nd, text in finished.items()]
        blob = json.dumps({"version": VERSION, "meta": self.meta(ex, search), "validity": names, "nodes": nodes,
                           "finished": finishes}, separators=(",", ":")).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as f:
            f.write(blob)
        os.replace(tmp, self.path)
        self.size = self.path.stat().st_size
        self.save_s = time.perf_counter() - start
