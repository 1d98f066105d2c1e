"""The per-request steering spec: plain data in ``SamplingParams.extra_args["uhead_steer"]``.

A request asks for steering with a list of terms, each adding ``scale * vector`` at one point
(see :mod:`.points`) of one decoder layer, to every token of the request (``"all"``), to the
tokens it generates (``"generated"``: positions >= the prompt length, so the first generated
token is still sampled from unsteered prompt rows) or from an explicit position on (an int)::

    SamplingParams(extra_args={"uhead_steer": [
        {"point": "mlp_out", "layer": 1, "vector": [0.1, ...], "scale": 4.0, "tokens": "generated"}]})

Both sides parse it here: the engine side to refuse a bad spec before anything runs, the worker
to apply it. Nothing but JSON-able lists, numbers and strings crosses the boundary.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from .points import STEER_POINTS, canonical_point
from ..errors import SteerSpecError

#: Key in ``SamplingParams.extra_args``.
STEER_KEY = "uhead_steer"
_TOKENS = ("all", "generated")


@dataclass(frozen=True)
class SteerTerm:
    """Add ``scale * vector`` at ``point`` of decoder layer ``layer`` for the chosen tokens."""

    point: str
    layer: int
    vector: tuple[float, ...]
    scale: float = 1.0
    tokens: str | int = "all"  # "all", "generated", or the first steered position

    def first_position(self, prompt_len: int) -> int:
        """The first position this term steers, for a request whose prompt has ``prompt_len`` tokens."""
        if self.tokens == "all":
            return 0
        if self.tokens == "generated":
            return prompt_len
        return int(self.tokens)

    def to_dict(self) -> dict:
        return {"point": self.point, "layer": self.layer, "vector": list(self.vector),
                "scale": self.scale, "tokens": self.tokens}


@dataclass(frozen=True)
class SteerSpec:
    """All steering terms of one request (terms at the same site add up)."""

    terms: tuple[SteerTerm, ...]

    @classmethod
    def from_extra_args(cls, extra_args: dict | None) -> "SteerSpec | None":
        """The spec under :data:`STEER_KEY`, None when there is none; ``SteerSpecError`` if malformed."""
        if not extra_args or extra_args.get(STEER_KEY) is None:
            return None
        raw = extra_args[STEER_KEY]
        if isinstance(raw, dict):
            raw = [raw]
        if not isinstance(raw, (list, tuple)) or not raw:
            raise SteerSpecError(f"'{STEER_KEY}' must be a non-empty list of terms, got {type(raw).__name__}")
        return cls(tuple(_term(i, t) for i, t in enumerate(raw)))

    def check(self, num_layers: int, hidden_size: int) -> None:
        """``SteerSpecError`` for a layer or vector size this model does not have."""
        for i, t in enumerate(self.terms):
            if t.layer >= num_layers:
                raise SteerSpecError(f"{STEER_KEY}[{i}]: layer {t.layer} out of range: the model has "
                                     f"{num_layers} decoder layers (0..{num_layers - 1})")
            if len(t.vector) != hidden_size:
                raise SteerSpecError(f"{STEER_KEY}[{i}]: vector has {len(t.vector)} entries, the model's "
                                     f"hidden size is {hidden_size}")

    def resolved(self, prompt_len: int) -> "SteerSpec":
        """The same spec with ``"generated"`` replaced by the first generated position, so a
        recompute of the whole sequence (as a prompt) steers exactly the same tokens."""
        return SteerSpec(tuple(SteerTerm(t.point, t.layer, t.vector, t.scale, t.first_position(prompt_len))
                               if t.tokens == "generated" else t for t in self.terms))

    @property
    def uses_prompt_length(self) -> bool:
        return any(t.tokens == "generated" for t in self.terms)

    def to_extra_args(self) -> dict:
        return {STEER_KEY: [t.to_dict() for t in self.terms]}

    def digest(self) -> str:
        """Stable hex digest: requests with equal digests compute equal states for equal tokens,
        so they (and only they) may share prefix-cached KV blocks and stored rows."""
        text = json.dumps([t.to_dict() for t in self.terms], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def _term(i: int, t: Any) -> SteerTerm:
    where = f"{STEER_KEY}[{i}]"
    if not isinstance(t, dict):
        raise SteerSpecError(f"{where} must be a dict with point, layer, vector, scale, tokens")
    unknown = set(t) - {"point", "layer", "vector", "scale", "tokens"}
    if unknown:
        raise SteerSpecError(f"{where}: unknown keys {sorted(unknown)}")
    try:
        point = canonical_point(t.get("point"), STEER_POINTS)
    except ValueError as exc:
        raise SteerSpecError(f"{where}: {exc}") from None
    layer = t.get("layer")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise SteerSpecError(f"{where}: layer must be a decoder-layer index >= 0, got {layer!r}")
    vector = t.get("vector")
    if not isinstance(vector, (list, tuple)) or not vector or not all(_is_number(x) for x in vector):
        raise SteerSpecError(f"{where}: vector must be a non-empty list of finite numbers")
    scale = t.get("scale", 1.0)
    if not _is_number(scale):
        raise SteerSpecError(f"{where}: scale must be a finite number, got {scale!r}")
    tokens = t.get("tokens", "all")
    if not (tokens in _TOKENS or (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0)):
        raise SteerSpecError(f"{where}: tokens must be 'all', 'generated' or a first position >= 0, got {tokens!r}")
    return SteerTerm(point, layer, tuple(float(x) for x in vector), float(scale), tokens)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


__all__ = ["STEER_KEY", "SteerSpec", "SteerSpecError", "SteerTerm"]
