r"""Per-candidate accumulation of step results across the steps of online best-of-n / beam search.

Strategies feed the text of a chosen candidate back as the next prompt, often trimmed (stop
tokens stripped, whitespace normalised) and re-tokenised. Token ids therefore do not identify a
trajectory across steps; its text does. Each entry is keyed by ``prompt + candidate text`` and a
new prompt continues the entry whose key is its longest string prefix (trailing whitespace
ignored). A prompt that ends inside a candidate's text (the strategy trimmed a stop marker or a
tail) still continues that candidate, as long as it reaches past that candidate's own prompt.
Distinct candidates have distinct keys, so they never overwrite each other.

The rule when several candidates fit a prompt (notably when one candidate's text is a prefix of a
sibling's), with keys and prompt compared after stripping trailing whitespace:

1. The prompt continues a candidate whose whole key it starts with; of those, the longest key.
2. A prompt that ends inside keys (a trimmed candidate) continues the one with the least trimmed
   away (the shortest such key), if the prompt reaches past that candidate's own prompt.
3. Between the two, the match that accounts for more of the prompt wins; an exact match (1) wins
   a tie. So with siblings "12" and "12\n5": "12" and "12\n" continue "12" (the texts cannot tell
   "12\n5" trimmed back to "12" apart, and the exact match is the likelier reading), "12\n5..."
   continues "12\n5", and "1" (inside both) continues "12".
"""


from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepRecord:
    """One step of one candidate: its text, token ids, the rows of its tokens and any scores."""

    text: str
    token_ids: list[int]
    hidden: torch.Tensor  # [rows of the step's tokens, L, H], at first a view into its call's rows
    scores: dict[str, float] = field(default_factory=dict)

    def compact(self) -> None:
        """Own a copy of the rows, so a trajectory that goes on does not keep its calls' buffers alive."""
        if self.hidden.untyped_storage().nbytes() > self.hidden.numel() * self.hidden.element_size():
            self.hidden = self.hidden.clone()


@dataclass
class _Entry:
    history: list[StepRecord]
    prompt_len: int  # length of the (normalised) prompt part of the key
    last_used: int


class StepCache:
    """Maps trajectory text to its accumulated steps; entries idle for too many calls are dropped."""

    def __init__(self, max_idle_calls: int = 2):
        if max_idle_calls < 1:
            raise ValueError("max_idle_calls must be >= 1")
        self.max_idle_calls = max_idle_calls
        self._entries: dict[str, _Entry] = {}
        self._call = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def tensors(self) -> list[torch.Tensor]:
        """Rows held by the entries (for accounting of what a generator holds)."""
        return [r.hidden for e in self._entries.values() for r in e.history]

    @staticmethod
    def _norm(text: str) -> str:
        return text.rstrip()

    def begin_call(self) -> None:
        """Start a generate call: drop entries that were neither created nor continued lately."""
        self._call += 1
        limit = self._call - self.max_idle_calls
        self._entries = {k: e for k, e in self._entries.items() if e.last_used >= limit}

    def history_for(self, prompt: str) -> list[StepRecord]:
        """Steps accumulated by the trajectory this prompt continues (empty for a fresh prompt)."""
        p = self._norm(prompt)
        best, best_rank = None, None
        for key, entry in self._entries.items():
            # Rank by how much of the prompt the candidate accounts for; a trimmed candidate
            # accounts for all of it.
            if p.startswith(key):
                rank = (len(key), 1, 0)  # the prompt continues this candidate
            elif key.startswith(p) and len(p) > entry.prompt_len:
                rank = (len(p), 0, -len(key))  # the prompt is this candidate, trimmed at the end
            else:
                continue
            if best_rank is None or rank > best_rank:
                best, best_rank = entry, rank
        if best is None:
            return []
        best.last_used = self._call
        for record in best.history:
            record.compact()
        return list(best.history)

    def extend(self, prompt: str, record: StepRecord, parent: list[StepRecord]) -> list[StepRecord]:
        """Record a new candidate step of ``prompt`` after ``parent`` (its ``history_for``).

        Look parents up for a whole call before extending, so candidates created in this call are
        never mistaken for parents of prompts in the same call.
        """
        history = parent + [record]
        key = self._norm(prompt + record.text)
        self._entries[key] = _Entry(history, len(self._norm(prompt)), self._call)
        return history
