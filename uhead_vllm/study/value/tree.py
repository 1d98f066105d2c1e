"""The step tree every search strategy of the value study walks: nodes, candidates, expansion.

A node is (question, accepted steps so far). Expanding it samples ``n`` candidate next steps
(one line each) with a seed derived from the node itself, so the children of a node are the same
whichever scorer or strategy reaches it: all scorers are compared on the *same* candidates, a node
is generated once however many scorers visit it, and paired comparisons are tight.

Each candidate is scored once, at expansion, by every scorer (validity: higher = more likely
right): heads on the exact hidden states of the candidate's own tokens (the generator's capture,
as :class:`uhead_vllm.thinkbooster.scorers.HeadScorer` reads them for thinkbooster), logprob
baselines on vLLM's logprobs, random choice from a hash of (seed, node, index).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...features import Pooling, StepSpan, pool
from ...tasks import Question
from ...thinkbooster.scorers import CandidateStep, HeadScorer


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed from ``parts`` that is the same in every process (unlike ``hash``)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class Node:
    """Question index + the text of the steps accepted so far (each ends with its newline)."""

    q: int
    prefix: str = ""


@dataclass
class Candidate:
    """One sampled next step and what every scorer and the labeller say about it."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool  # ended with end-of-sequence: the answer is complete
    validity: dict[str, float] = field(default_factory=dict)
    features: torch.Tensor | None = None  # pooled head features, kept only when collecting data
    value: float | None = None  # label (labels.py): share of rollouts from it that are right
    rollout_tokens: int = 0  # tokens of the rollouts behind ``value`` (replayed ones are charged again)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


#: Logprob baselines, as validity = 1 / (1 + u) of thinkbooster's scorers' uncertainty u.
def _entropy(lps: list[np.ndarray]) -> float:
    return float(np.mean([-(np.exp(lp) * lp).sum() for lp in lps]))


class Expander:
    """Generates and scores the children of nodes, batched, each node once.

    ``heads``: name -> :class:`HeadScorer`; ``feature_head``: the scorer whose pooled features are
    kept on each candidate (training data). Logprob scorers ``entropy`` (mean token entropy of
    the top-k), ``perplexity`` (mean NLL) and ``msp`` (sequence NLL, i.e. maximum sequence
    probability) and ``random`` are always computed.
    """

    BASELINES: tuple[str, ...] = ("entropy", "perplexity", "msp", "random")

    def __init__(
        self,
        generator: Any,
        questions: Sequence[Question],
        chat: Callable[[Question], list[dict]],
        heads: dict[str, HeadScorer],
        *,
        temperature: float,
        max_step_tokens: int,
        seed: int,
        logprobs: int = 10,
        feature_head: HeadScorer | None = None,
        feature_pooling: Pooling = "mean_last",
    ):
        self.gen = generator
        self.questions = list(questions)
        self.heads = heads
        self.temperature = temperature
        self.max_step_tokens = max_step_tokens
        self.seed = seed
        self.logprobs = logprobs
        self.feature_head = feature_head
        self.feature_pooling = feature_pooling
        tok = generator.tokenizer
        self.tokenizer = tok
        self._chat_text = [tok.apply_chat_template(chat(q), tokenize=False, add_generation_prompt=True)
                           for q in self.questions]
        self._special = frozenset(int(t) for t in (tok.all_special_ids or []))
        self.children: dict[tuple[Node, int], list[Candidate]] = {}
        self.generated_tokens = 0
        # Step-level resume (resume.py): who made each entry's candidates and labels, entries
        # loaded from a tree file and not asked for yet, and what replaying them charged.
        self.owner = ""
        self.origin: dict[tuple[Node, int], tuple[str, str | None]] = {}
        self.pending: dict[tuple[Node, int], list[Candidate]] = {}
        self.replayed = 0
        self.replayed_rollout_tokens = 0
        self.last_stats: Any = None  # the generator's counters of the latest expansion (progress lines)

    # ------------------------------------------------------------------ prompts
    def prompt_text(self, node: Node) -> str:
        return self._chat_text[node.q] + node.prefix

    def prompt_ids(self, node: Node, extra: str = "") -> dict:
        ids = self.tokenizer(self.prompt_text(node) + extra, add_special_tokens=False)["input_ids"]
        return {"prompt_token_ids": ids}

    # ------------------------------------------------------------------ expansion
    def expand(self, nodes: Sequence[Node], n: int) -> list[list[Candidate]]:
        """Children of each node (``n`` candidates), generating only nodes not expanded before.

        Children loaded from a tree file are replayed, not generated; their tokens (and their
        labels' rollout tokens) are charged again when the ``owner`` that made them asks, so a
        resumed unit part counts exactly what it would have generated in one go, and children
        another part made stay free, as they are when that part ran earlier in the same process.
        """
        for nd in dict.fromkeys(nodes):
            if (nd, n) in self.pending:
                kids = self.children[(nd, n)] = self.pending.pop((nd, n))
                made, labelled = self.origin[(nd, n)]
                if made == self.owner:
                    self.generated_tokens += sum(c.n_tokens for c in kids)
                if labelled == self.owner:
                    self.replayed_rollout_tokens += sum(c.rollout_tokens for c in kids)
                self.replayed += 1
        todo = list(dict.fromkeys(nd for nd in nodes if (nd, n) not in self.children))
        if todo:
            self._generate(todo, n)
        return [self.children[(nd, n)] for nd in nodes]

    def _params(self, node: Node, n: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(n=n, temperature=self.temperature, top_p=1.0, max_tokens=self.max_step_tokens,
                              min_tokens=2, stop=["\n"], include_stop_str_in_output=True, logprobs=self.logprobs,
                              seed=stable_seed(self.seed, node.q, node.prefix))

    def _generate(self, nodes: list[Node], n: int) -> None:
        # The last sampled token (the step's newline, an EOS, or a length cut) has no row unless
        # recomputed, which re-runs every prompt; steps are scored on their tokens before it, as
        # thinkbooster scores a step without its stop string. min_tokens=2 keeps that non-empty.
        res = self.gen.generate([self.prompt_ids(nd) for nd in nodes], [self._params(nd, n) for nd in nodes],
                                compute_last_token=False, window="generated")
        self.last_stats = res.stats
        pending: list[tuple[Candidate, CandidateStep]] = []
        for i, nd in enumerate(nodes):
            kids = []
            for s, co in enumerate(res.outputs[i].outputs):
                hs = res.hidden_states[i][s]
                ids = [int(t) for t in co.token_ids]
                # End of sequence: EOS (stop_reason None) or an extra EOS id from the generation
                # config (vLLM puts those in stop_token_ids: stop_reason = the id); the "\n" step
                # stop is a string.
                finished = co.finish_reason == "stop" and not isinstance(co.stop_reason, str)
                cand = Candidate(co.text, tuple(ids), finished)
                self.generated_tokens += len(ids)
                rows = hs.generated_rows()
                step = CandidateStep(ids, StepSpan(0, min(len(ids) - 1, rows.shape[0])), rows, hs.layers, co.logprobs)
                if len(step.span) == 0:
                    raise RuntimeError(f"a {len(ids)}-token candidate has no scorable token (min_tokens=2 "
                                       "should prevent it)")
                cand.validity.update(self._baselines(step, nd, s))
                pending.append((cand, step))
                kids.append(cand)
            self.children[(nd, n)] = kids
            self.origin[(nd, n)] = (self.owner, None)
        self._score_heads(pending)

    def _baselines(self, step: CandidateStep, node: Node, index: int) -> dict[str, float]:
        lps, sampled = [], []
        for p in range(step.span.start, step.span.end):
            assert step.logprobs is not None  # steps are generated with logprobs
            d = step.logprobs[p]
            lp = np.array([float(v.logprob) for v in d.values()], dtype=np.float64)
            lps.append(lp[np.isfinite(lp)])
            sampled.append(float(d[step.output_token_ids[p]].logprob))
        nll = -np.asarray(sampled)
        rand = stable_seed("random", self.seed, node.q, node.prefix, index) / 0x7FFFFFFF
        return {"entropy": 1 / (1 + _entropy(lps)), "perplexity": 1 / (1 + float(nll.mean())),
                "msp": 1 / (1 + float(nll.sum())), "random": rand}

    def _score_heads(self, pending: list[tuple[Candidate, CandidateStep]]) -> None:
        """Every head on every new candidate in one batch; features kept for training data."""
        cache: dict[int, list[torch.Tensor]] = {}
        for name, scorer in self.heads.items():
            key = id(scorer.recipe)
            feats = cache.get(key)
            if feats is None:
                feats = cache[key] = scorer.features_batch([step for _, step in pending])
            p: np.ndarray | list[float] = scorer.head.predict_proba(feats) if feats else []
            for (cand, _), pw in zip(pending, p):
                cand.validity[name] = 1.0 - float(pw)
        if self.feature_head is not None:
            feats = self.feature_head.features_batch([step for _, step in pending])
            for (cand, _), f in zip(pending, feats):
                cand.features = pool(f, self.feature_pooling).to(torch.float32)
        for _, step in pending:
            step.hidden = None  # rows are not needed any more
