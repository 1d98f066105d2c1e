"""Online best-of-n and beam search over the shared step tree, for many scorers at once.

Both strategies follow thinkbooster's (``online_best_of_n``: keep the best of ``n`` candidates per
step; ``beam_search``: keep the ``beam_width`` best partial answers, each expanded into
``per_beam`` candidates, ranked by the *minimum* step validity so far, thinkbooster's default
aggregation). Every scorer walks its own path; nodes several scorers reach are generated once
(see :mod:`.tree`). A scorer is charged the tokens of every candidate it had generated, as if it
had run alone. ``oracle`` scores a candidate by its label (rollouts): the ceiling of choosing.

Answers not finished after ``max_steps`` lines get a greedy final phase (``finish_tokens``).
With a :class:`~.resume.TreeStore` the tree and the finishes are saved after every step and a
new process replays them (step-level resume). Majority vote and greedy decoding, the scorer-free
baselines, sample whole answers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .labels import label_candidates
from .resume import TreeStore
from .tree import Candidate, Expander, Node

ORACLE = "oracle"


@dataclass
class Path:
    """One partial answer of one scorer."""

    node: Node
    done: bool = False
    min_validity: float = float("inf")
    tokens: int = 0


@dataclass
class Outcome:
    """Final answer text per question and the tokens charged to it."""

    texts: list[str]
    tokens: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


def _capture_line(stats: Any) -> str:
    """The capture counters of an expansion, for the progress line (empty without one)."""
    if stats is None:
        return ""
    return (f"; capture: {stats.rows_captured} rows, record {stats.record_seconds:.1f} s, place "
            f"{stats.place_seconds:.1f} s, {stats.rows_from_shared_prefix} from shared prefixes, "
            f"{stats.rows_from_store} from the store, {stats.rows_recomputed} recomputed")


class TreeSearch:
    """Runs strategies on an :class:`Expander`; labels candidates lazily for the oracle."""

    def __init__(self, expander: Expander, *, max_steps: int, finish_tokens: int, rollouts: int,
                 rollout_tokens: int, progress: Callable[[str], Any] | None = None,
                 store: TreeStore | None = None):
        self.ex = expander
        self.max_steps = max_steps
        self.finish_tokens = finish_tokens
        self.rollouts = rollouts
        self.rollout_tokens = rollout_tokens
        self.rollout_generated = 0
        self._finished: dict[Node, str] = {}
        self._finish_cost: dict[Node, int] = {}
        self.progress = progress or (lambda _msg: None)
        self.store = store
        self.on_save: Callable[[], Any] | None = None  # called after each save (the unit's bookkeeping)
        if store is not None:
            if expander.feature_head is not None:
                raise ValueError("a tree file keeps no features: use a store only for search, not step data")
            loaded = store.load(expander, self._store_settings(), self._finished, self._finish_cost)
            if loaded:
                self.progress(f"step tree: {loaded} expanded nodes, {len(self._finished)} finishes from {store.path}")

    def _store_settings(self) -> dict[str, int]:
        """The settings a saved tree's labels and finishes depend on (see :meth:`TreeStore.meta`)."""
        return {"finish_tokens": self.finish_tokens, "rollouts": self.rollouts, "rollout_tokens": self.rollout_tokens}

    def _save(self) -> None:
        if self.store is not None:
            self.store.save(self.ex, self._store_settings(), self._finished, self._finish_cost)
            self.progress(f"step tree saved ({self.store.size / 1e6:.1f} MB, {self.store.save_s:.2f} s)")
        if self.on_save is not None:
            self.on_save()

    # ------------------------------------------------------------------ shared pieces
    def _children(self, nodes: list[Node], n: int, scorers: Sequence[str]) -> list[list[Candidate]]:
        made, replayed_rollouts = len(self.ex.origin), self.ex.replayed_rollout_tokens
        self.ex.last_stats = None
        started = time.perf_counter()
        kids = self.ex.expand(nodes, n)
        expanded = time.perf_counter()
        self.rollout_generated += self.ex.replayed_rollout_tokens - replayed_rollouts
        todo = []
        if ORACLE in scorers:  # each node once: several scorers' paths often share it
            todo = list({nd: cs for nd, cs in zip(nodes, kids) if any(c.value is None for c in cs)}.items())
            if todo:
                self.rollout_generated += label_candidates(self.ex, todo, k=self.rollouts,
                                                           max_tokens=self.rollout_tokens)
                for nd, _ in todo:
                    self.ex.origin[(nd, n)] = (self.ex.origin[(nd, n)][0], self.ex.owner)
        if todo or len(self.ex.origin) != made:
            # Where a step's time goes (a slow step is then located without a profiler).
            self.progress(f"  {len(self.ex.origin) - made} nodes expanded in {expanded - started:.1f} s, "
                          f"{len(todo)} labelled by rollouts in {time.perf_counter() - expanded:.1f} s"
                          + _capture_line(self.ex.last_stats))
            self._save()
        return kids

    @staticmethod
    def _validity(cand: Candidate, scorer: str) -> float:
        if scorer == ORACLE:
            assert cand.value is not None  # the oracle reads labelled candidates only
            return float(cand.value)
        return cand.validity[scorer]

    def _finish(self, paths: dict[str, list[list[Path]]]) -> dict[str, Outcome]:
        """Greedy final phase for unfinished paths, then the answer text per scorer and question."""
        todo = list(dict.fromkeys(qp[0].node for ps in paths.values() for qp in ps
                                  if not qp[0].done and qp[0].node not in self._finished))
        if todo:
            self._greedy_finish(todo)
            self._save()
        result = {}
        for name, per_q in paths.items():
            texts, tokens = [], []
            for qp in per_q:
                best = qp[0]
                extra_text = "" if best.done else self._finished[best.node]
                texts.append(best.node.prefix + extra_text)
                tokens.append(best.tokens + (0 if best.done else self._finish_cost[best.node]))
            result[name] = Outcome(texts, tokens)
        return result

    def _greedy_finish(self, nodes: list[Node]) -> None:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=self.finish_tokens)
        outs = self.ex.gen.llm.generate([self.ex.prompt_ids(nd) for nd in nodes], sp, use_tqdm=False)
        for nd, ro in zip(nodes, outs):
            self._finished[nd] = ro.outputs[0].text
            self._finish_cost[nd] = len(ro.outputs[0].token_ids)

    # ------------------------------------------------------------------ online best-of-n
    def best_of_n(self, scorers: Sequence[str], n: int) -> dict[str, Outcome]:
        nq = len(self.ex.questions)
        paths = {s: [[Path(Node(q))] for q in range(nq)] for s in scorers}
        for depth in range(self.max_steps):
            live = [(s, q) for s in scorers for q in range(nq) if not paths[s][q][0].done]
            if not live:
                break
            self.progress(f"best-of-{n} step {depth + 1}: {len(live)} paths")
            nodes = [paths[s][q][0].node for s, q in live]
            kids = self._children(nodes, n, scorers)
            for (s, q), cands in zip(live, kids):
                p = paths[s][q][0]
                best = max(range(len(cands)), key=lambda i: self._validity(cands[i], s))
                c = cands[best]
                p.tokens += sum(x.n_tokens for x in cands)
                p.min_validity = min(p.min_validity, self._validity(c, s))
                p.node = Node(q, p.node.prefix + c.text)
                p.done = c.finished
        return self._finish(paths)

    # ------------------------------------------------------------------ beam search
    def beam_search(self, scorers: Sequence[str], beam_width: int, per_beam: int) -> dict[str, Outcome]:
        nq = len(self.ex.questions)
        beams = {s: [[Path(Node(q))] for q in range(nq)] for s in scorers}
        spent = {s: [0] * nq for s in scorers}
        for depth in range(self.max_steps):
            live = [(s, q, p) for s in scorers for q in range(nq) for p in beams[s][q] if not p.done]
            if not live:
                break
            self.progress(f"beam {beam_width}x{per_beam} step {depth + 1}: {len(live)} beams")
            kids = self._children([p.node for _, _, p in live], per_beam, scorers)
            grown: dict[tuple[str, int], list[Path]] = {}
            for (s, q, p), cands in zip(live, kids):
                spent[s][q] += sum(c.n_tokens for c in cands)
                for c in cands:
                    grown.setdefault((s, q), []).append(Path(
                        Node(q, p.node.prefix + c.text), c.finished, min(p.min_validity, self._validity(c, s))))
            for s in scorers:
                for q in range(nq):
                    pool = [p for p in beams[s][q] if p.done] + grown.get((s, q), [])
                    if pool:
                        beams[s][q] = sorted(pool, key=lambda p: -p.min_validity)[:beam_width]
        for s in scorers:
            for q in range(nq):
                ranked = sorted(beams[s][q], key=lambda p: (not p.done, -p.min_validity))
                ranked[0].tokens = spent[s][q]
                beams[s][q] = ranked
        return self._finish(beams)


def sample_answers(expander: Expander, n: int, temperature: float, max_tokens: int, seed: int) -> list[list[tuple[str, int]]]:
    """``n`` whole answers per question (text, tokens): greedy and majority-vote baselines."""
    from vllm import SamplingParams

    from .tree import stable_seed

    prompts = [expander.prompt_ids(Node(q)) for q in range(len(expander.questions))]
    params = [SamplingParams(n=n, temperature=temperature, top_p=1.0, max_tokens=max_tokens,
                             seed=stable_seed("whole", seed, q)) for q in range(len(prompts))]
    outs = expander.gen.llm.generate(prompts, params, use_tqdm=False)
    return [[(co.text, len(co.token_ids)) for co in ro.outputs] for ro in outs]


def majority_vote(answers: list[tuple[str, int]], extract: Callable[[str], str | None]) -> tuple[str, int]:
    """The answer text whose extracted answer is most frequent (first seen wins ties); total tokens."""
    counts: dict[str | None, int] = {}
    first: dict[str | None, str] = {}
    for text, _ in answers:
        key = extract(text)
        counts[key] = counts.get(key, 0) + (key is not None)
        first.setdefault(key, text)
    best = max(counts, key=lambda k: counts[k])
    return first[best], sum(t for _, t in answers)
