"""Typed per-step scores from an ``uhead-vllm serve`` server, through the ``openai`` package.

    from uhead_vllm.client import UncertaintyClient
    client = UncertaintyClient("http://localhost:8000/v1")
    [answer] = client.chat("What is 45 + 38?")
    answer.answer_p_wrong, [(s.text, s.p_wrong) for s in answer.steps]
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class StepScore:
    """One step: its text, its generated-token span ``[token_start, token_end)`` and P(wrong);
    ``features``: the head's pooled inputs for the step, when asked for (``features=True``)."""

    text: str
    token_start: int
    token_end: int
    p_wrong: float | None
    features: list[float] | None = None


@dataclass
class ScoredChoice:
    """One choice of a response with the server's uncertainty for it."""

    index: int
    text: str
    finish_reason: str | None
    answer_p_wrong: float | None
    steps: list[StepScore] = field(default_factory=list)
    rows: dict[str, Any] | None = None  # as sent; decode with :func:`decode_rows`
    stopped_step: int | None = None  # the step whose P(wrong) reached ``stop_above`` (the choice was stopped)
    kept: bool | None = None  # ``keep_below``: under the threshold (False: no choice was; the best one)

    @classmethod
    def from_openai(cls, choice: Any) -> "ScoredChoice":
        extra = choice.model_extra or {}
        unc = extra.get("uncertainty")
        if unc is None:
            raise ValueError("the response carries no uncertainty: is the server `uhead-vllm serve`?")
        if "error" in unc:
            raise RuntimeError(f"the server could not score choice {choice.index}: {unc['error']}")
        message = getattr(choice, "message", None)
        text = message.content if message is not None else choice.text
        return cls(choice.index, text or "", choice.finish_reason, unc.get("answer_p_wrong"),
                   [StepScore(**s) for s in unc.get("steps", [])], unc.get("rows"), unc.get("stop_step"),
                   unc.get("kept"))


def decode_rows(rows: dict[str, Any]) -> tuple[torch.Tensor, list[int], list[int | str]]:
    """``(hidden [rows, columns, H], token_ids, columns)``: row p = state after reading token p;
    ``columns`` names each column: the layers' HF indices (ints), then the capture points asked
    for (``"mlp_out.14"``; a server started with ``--points``)."""
    from safetensors.torch import load

    t = load(base64.b64decode(rows["safetensors_b64"]))
    return t["hidden"], t["token_ids"].tolist(), [*rows["layers"], *rows.get("points", [])]


class UncertaintyClient:
    """Chat and completions with ``uncertainty`` asked for; returns :class:`ScoredChoice` lists."""

    def __init__(self, base_url: str = "http://localhost:8000/v1", api_key: str = "none",
                 model: str | None = None, **client_kwargs: Any):
        from openai import OpenAI

        self.openai = OpenAI(base_url=base_url, api_key=api_key, **client_kwargs)
        self.model = model or self.openai.models.list().data[0].id

    @staticmethod
    def _body(rows: Sequence[int] | None, max_bytes: int | None, features: bool = False,
              points: Sequence[Any] | None = None, stop_above: float | None = None,
              keep_below: float | None = None, extra_body: dict | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {"features": True} if features else {}
        if rows or points:
            spec["rows"] = {"layers": list(rows or [])}
            if points:
                spec["rows"]["points"] = [p if isinstance(p, str) else list(p) for p in points]
        if max_bytes:
            spec["max_bytes"] = int(max_bytes)
        for name, value in (("stop_above", stop_above), ("keep_below", keep_below)):
            if value is not None:
                spec[name] = float(value)
        return {**(extra_body or {}), "uncertainty": spec or True}

    def chat(self, messages: str | list[dict], *, rows: Sequence[int] | None = None, max_bytes: int | None = None,
             features: bool = False, max_tokens: int = 128, temperature: float = 0.0,
             points: Sequence[Any] | None = None, stop_above: float | None = None, keep_below: float | None = None,
             extra_body: dict | None = None, **kwargs: Any) -> list[ScoredChoice]:
        """Answer a question (a string) or a conversation; one :class:`ScoredChoice` per choice.
        ``rows``: layers whose rows to return; ``points``: capture points too (``"mlp_out.14"`` or
        ``("mlp_out", 14)``, captured by the server); decode them with :func:`decode_rows`.
        ``stop_above``: stop a choice once a step's P(wrong) reaches it (``finish_reason``
        "stop_above", ``stopped_step``); ``keep_below``: keep the choices under it (docs/serving.md)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = self._body(rows, max_bytes, features, points, stop_above, keep_below, extra_body)
        res = self.openai.chat.completions.create(model=self.model, messages=messages, max_tokens=max_tokens,
                                                  temperature=temperature, extra_body=body, **kwargs)
        return [ScoredChoice.from_openai(c) for c in res.choices]

    def complete(self, prompt: str | list[str], *, rows: Sequence[int] | None = None, max_bytes: int | None = None,
                 features: bool = False, max_tokens: int = 128, temperature: float = 0.0,
                 points: Sequence[Any] | None = None, stop_above: float | None = None,
                 keep_below: float | None = None, extra_body: dict | None = None,
                 **kwargs: Any) -> list[ScoredChoice]:
        """As :meth:`chat`, for a prompt or a list of prompts."""
        body = self._body(rows, max_bytes, features, points, stop_above, keep_below, extra_body)
        res = self.openai.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens,
                                             temperature=temperature, extra_body=body, **kwargs)
        return [ScoredChoice.from_openai(c) for c in res.choices]
