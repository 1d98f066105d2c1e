"""What the server keeps about one uncertainty request while it runs.

vLLM's outputs (token ids, logprobs) are observed as the engine hands them to the OpenAI handler,
so the scores use exactly the ids vLLM ran, never re-tokenised text. Captured rows are kept per
``(tag, sample)`` as they arrive from the worker; each prompt of a request has its own tag and
each of its n samples its own sample index, so rows of different sequences never meet.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.protocol import CapturedRows
from .spec import BadUncertaintyRequest, UncertaintySpec


def new_tag() -> int:
    """A capture tag unique across API server processes sharing one engine (62 random bits)."""
    return secrets.randbits(62)


@dataclass
class SequenceState:
    """One choice: the ids vLLM ran and the logprobs it returned, as they stream in."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    steps_scored: int = 0  # steps scored while the choice ran (streamed, or checked against stop_above)
    pending_steps: list[dict] = field(default_factory=list)  # scored, not yet sent in a stream chunk
    text_seen: int = 0  # characters of ``text`` already looked at for a possible step end
    boundary_pending: bool = False  # a step may have ended: re-split on the next outputs
    offsets: Any = None  # the running choice's token offsets (features.AnswerOffsets), kept between splits
    step_error: str | None = None  # scoring the running choice failed (its final object still comes)
    error_sent: bool = False
    stopped_step: int | None = None  # the step whose P(wrong) reached stop_above (the choice was aborted)


@dataclass
class PromptState:
    tag: int
    n: int
    delta: bool
    request_id: str = ""  # the id vLLM's handler gave this generate call (to abort one of its samples)
    prompt_token_ids: list[int] | None = None
    seqs: dict[int, SequenceState] = field(default_factory=dict)
    prompt_len: int = 0  # as the handler knew it before the engine answered (0: unknown)


@dataclass
class _RowChunks:
    positions: list[torch.Tensor] = field(default_factory=list)
    token_ids: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)


class RequestRecord:
    """State of one request: prompts in the order the handler submitted them, rows by sequence."""

    def __init__(self, key: str, spec: UncertaintySpec, logprobs_needed: int, salt: str = "",
                 steer_args: dict | None = None):
        self.key = key
        self.spec = spec
        self.logprobs_needed = logprobs_needed
        self.salt = salt  # vLLM cache_salt of a steered request ("" = plain): also the row-store key prefix
        self.steer_args = dict(steer_args or {})  # its steering, for recomputes
        self.prompts: list[PromptState] = []
        self._rows: dict[tuple[int, int], _RowChunks] = {}
        self.capture_errors: list[str] = []
        self.row_bytes = 0  # bytes of one returned row (columns x hidden x dtype), 0 = no rows asked
        self.rows_bound = 0  # most bytes the rows of the prompts registered so far can take
        self.rows_sent = 0  # bytes of rows already sent in a stream's finished choices

    # ------------------------------------------------------------------ engine outputs
    @property
    def watches_running(self) -> bool:
        """The request acts while its choices run (``stop_above``): the tap must see every output."""
        return self.spec.stop_above is not None

    def new_prompt(self, n: int, delta: bool, prompt_len: int | None = None,
                   max_tokens: int | None = None, request_id: str = "") -> tuple[int, int]:
        """Register one generate call; returns (prompt index, its tag).

        With the prompt's length and vLLM's ``max_tokens`` the request's rows budget is checked
        here, before anything runs, streamed or not: its sequences can return at most
        ``prompt_len + max_tokens - 1`` rows each (the last sampled token has none). Raises
        :class:`BadUncertaintyRequest` (HTTP 400) when the response's rows could exceed it."""
        if self.row_bytes and prompt_len is not None and max_tokens is not None:
            bound = self.rows_bound + n * (prompt_len + max_tokens - 1) * self.row_bytes
            if bound > self.spec.max_bytes:
                raise BadUncertaintyRequest(
                    f"rows budget exceeded: the rows of this response can take {bound} bytes "
                    f"(this prompt: {n} sequence(s) x ({prompt_len} prompt + {max_tokens} max_tokens - 1) rows "
                    f"x {self.row_bytes} bytes) > max_bytes {self.spec.max_bytes}; ask for fewer layers, "
                    "points or tokens, bfloat16, or a larger max_bytes")
            self.rows_bound = bound
        self.prompts.append(PromptState(new_tag(), n, delta, request_id, prompt_len=prompt_len or 0))
        return len(self.prompts) - 1, self.prompts[-1].tag

    def observe(self, prompt_index: int, request_output: Any) -> None:
        p = self.prompts[prompt_index]
        if p.prompt_token_ids is None and request_output.prompt_token_ids is not None:
            p.prompt_token_ids = list(request_output.prompt_token_ids)
        for out in request_output.outputs:
            s = p.seqs.setdefault(out.index, SequenceState())
            logprobs = list(out.logprobs) if out.logprobs is not None else []
            if p.delta:
                s.token_ids.extend(out.token_ids)
                s.logprobs.extend(logprobs)
                s.text += out.text
            else:
                s.token_ids, s.logprobs, s.text = list(out.token_ids), logprobs, out.text
            s.finish_reason = out.finish_reason

    @property
    def tags(self) -> list[int]:
        return [p.tag for p in self.prompts]

    def rows_expected(self, margin: int = 8) -> int:
        """About how many rows the worker holds for this request at most: every sequence's prompt
        and the tokens seen so far, plus ``margin`` tokens the engine may be ahead by."""
        return sum(p.n * (max(p.prompt_len, len(p.prompt_token_ids or ())) + margin)
                   + sum(len(s.token_ids) for s in p.seqs.values()) for p in self.prompts)

    def locate(self, choice_index: int) -> tuple[int, int]:
        """(prompt index, sample) of an OpenAI choice index (vLLM: prompt * n + sample)."""
        n = self.prompts[0].n if self.prompts else 1
        return divmod(choice_index, n)

    # ------------------------------------------------------------------ captured rows
    def add_rows(self, rows: CapturedRows) -> None:
        """Keep (copy) this request's rows of a take; a take may carry other requests' rows too."""
        if rows.error:
            self.capture_errors.append(rows.error)
        if not rows.num_rows:
            return
        mine = torch.isin(rows.tags, torch.tensor(self.tags, dtype=rows.tags.dtype)).nonzero().flatten()
        if not mine.numel():
            return
        order = mine[torch.argsort(rows.samples[mine], stable=True)]
        order = order[torch.argsort(rows.tags[order], stable=True)]  # by (tag, sample)
        keys = torch.stack([rows.tags[order], rows.samples[order]], 1)
        uniq, counts = torch.unique_consecutive(keys, dim=0, return_counts=True)
        start = 0
        for (tag, sample), c in zip(uniq.tolist(), counts.tolist()):
            idx = order[start : start + c]
            start += c
            chunks = self._rows.setdefault((tag, sample), _RowChunks())
            chunks.positions.append(rows.positions[idx])
            chunks.token_ids.append(rows.token_ids[idx])
            chunks.hidden.append(rows.hidden[idx])

    def captured(self, tag: int, sample: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(positions, input token ids, hidden) captured so far for one sequence."""
        c = self._rows.get((tag, sample))
        if c is None or not c.positions:
            return None
        if len(c.positions) > 1:  # concatenate once, keep one chunk
            c.positions, c.token_ids, c.hidden = ([torch.cat(c.positions)], [torch.cat(c.token_ids)],
                                                  [torch.cat(c.hidden)])
        return c.positions[0], c.token_ids[0], c.hidden[0]

    def bytes_held(self) -> int:
        return sum(h.numel() * h.element_size() for c in self._rows.values() for h in c.hidden)
