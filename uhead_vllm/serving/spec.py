"""The request's ``uncertainty`` field: parsed and checked before anything runs.

Everything a client can get wrong is refused here with a message that says what to send instead,
so the handler can answer HTTP 400 and the engine never sees a malformed request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..capture.points import Site, parse_sites, site_name
from ..errors import BadUncertaintyRequest

#: Prefix (any case) of every ``vllm_xargs`` / ``extra_args`` key the engine side reads: capture
#: tags (``uhead_vllm``), the server's marks, steering (``uhead_steer``). Clients may not send them
#: (a forged tag would read another request's rows), except ``uhead_steer`` where the server
#: checks and salts it (chat and completions).
RESERVED_XARGS_PREFIX = "uhead_"
#: Most a request's steering may add at one site: the sum over its terms of ``|scale| * ||vector||``
#: (float16 models: the square root of float16's largest value). Larger additions overflow the
#: model's arithmetic into inf / NaN states and scores.
MAX_STEER_NORM = 1e6
_KEYS = {"head", "steps", "rows", "features", "max_bytes", "stop_above", "keep_below"}
_ROW_KEYS = {"layers", "points", "dtype"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class RowsSpec:
    """Captured rows to return: HF hidden-state layer indices, then capture points (``(point,
    decoder layer)`` sites) as columns, and the dtype they travel in."""

    layers: tuple[int, ...]
    dtype: str = "float32"
    points: tuple[Site, ...] = ()

    @property
    def bytes_per_value(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def num_columns(self) -> int:
        return len(self.layers) + len(self.points)


@dataclass(frozen=True)
class UncertaintySpec:
    """What one request asked for; ``max_bytes`` bounds the rows it may receive."""

    steps: bool = True
    rows: RowsSpec | None = None
    max_bytes: int = 0
    head: str | None = None
    features: bool = False  # each step's pooled head input features, for training one's own head
    stop_above: float | None = None  # end a choice once a completed step's P(wrong) reaches this
    keep_below: float | None = None  # return only choices whose answer P(wrong) is below this


@dataclass(frozen=True)
class ServerLimits:
    """What this server can serve: the captured layers, hidden size, its head, the byte cap, the
    captured points (``serve --points``)."""

    captured_layers: tuple[int, ...]
    hidden_size: int
    head_name: str | None
    max_rows_bytes: int
    captured_points: tuple[Site, ...] = ()
    reduced: bool = False  # the worker reduces rows to the head's inputs (serve --scores-on-device)


#: The answer to a request for rows or features on a server whose worker keeps neither.
REDUCED_REFUSAL = ("this server reduces rows to the head's inputs on the device; start it without "
                   "--scores-on-device to get rows")


def parse_uncertainty(value: Any, limits: ServerLimits) -> UncertaintySpec | None:
    """``None`` when the client did not ask (absent, null or false); else a checked spec."""
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise BadUncertaintyRequest(
            f"'uncertainty' must be true or an object like {{\"steps\": true, \"rows\": {{\"layers\": "
            f"[{limits.captured_layers[0]}]}}, \"max_bytes\": 1000000}}; got {type(value).__name__}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise BadUncertaintyRequest(f"unknown key(s) {unknown} in 'uncertainty'; allowed: {sorted(_KEYS)}")
    head = value.get("head")
    if head is not None:
        if limits.head_name is None:
            raise BadUncertaintyRequest("this server has no uncertainty head; ask only for rows")
        if head != limits.head_name:
            raise BadUncertaintyRequest(f"unknown head {head!r}; this server serves head {limits.head_name!r}")
    steps = value.get("steps", limits.head_name is not None)
    if not isinstance(steps, bool):
        raise BadUncertaintyRequest(f"'uncertainty.steps' must be a boolean, got {steps!r}")
    if steps and limits.head_name is None:
        raise BadUncertaintyRequest("this server has no uncertainty head: 'steps' cannot be scored; "
                                    "ask for rows only ({\"steps\": false, \"rows\": {...}})")
    features = value.get("features", False)
    if not isinstance(features, bool):
        raise BadUncertaintyRequest(f"'uncertainty.features' must be a boolean, got {features!r}")
    if features and not steps:
        raise BadUncertaintyRequest("'uncertainty.features' are the head's inputs per step: they need "
                                    "'steps' (and a head)")
    stop_above = _threshold(value, "stop_above", steps)
    keep_below = _threshold(value, "keep_below", steps)
    if limits.reduced and (value.get("rows") not in (None, False) or features):
        raise BadUncertaintyRequest(REDUCED_REFUSAL if features is False else
                                    REDUCED_REFUSAL.replace("get rows", "get the head's features"))
    rows = _parse_rows(value.get("rows"), limits)
    max_bytes = value.get("max_bytes", limits.max_rows_bytes)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise BadUncertaintyRequest(f"'uncertainty.max_bytes' must be a positive integer, got {max_bytes!r}")
    if max_bytes > limits.max_rows_bytes:
        raise BadUncertaintyRequest(f"'uncertainty.max_bytes' {max_bytes} exceeds this server's limit "
                                    f"{limits.max_rows_bytes} (--max-rows-bytes)")
    if not steps and rows is None and limits.head_name is None:
        raise BadUncertaintyRequest("this server has no uncertainty head (--head none): ask for rows, "
                                    "e.g. {\"rows\": {\"layers\": [...]}}")
    if not steps and rows is None:
        raise BadUncertaintyRequest("'uncertainty' asks for nothing: set steps to true or ask for rows")
    return UncertaintySpec(steps=steps, rows=rows, max_bytes=max_bytes, head=head, features=features,
                           stop_above=stop_above, keep_below=keep_below)


def _threshold(value: dict, key: str, steps: bool) -> float | None:
    """A P(wrong) threshold in (0, 1] (``stop_above``, ``keep_below``); both act on the head's scores."""
    x = value.get(key)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 < x <= 1.0:  # NaN fails the range too
        raise BadUncertaintyRequest(f"'uncertainty.{key}' must be a number in (0, 1], a P(wrong); got {x!r}")
    if not steps:
        raise BadUncertaintyRequest(f"'uncertainty.{key}' acts on the head's step scores: it needs 'steps' (and a head)")
    return float(x)


def _parse_rows(value: Any, limits: ServerLimits) -> RowsSpec | None:
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise BadUncertaintyRequest("'uncertainty.rows' must be an object like {\"layers\": [0, 2]}")
    unknown = sorted(set(value) - _ROW_KEYS)
    if unknown:
        raise BadUncertaintyRequest(f"unknown key(s) {unknown} in 'uncertainty.rows'; allowed: {sorted(_ROW_KEYS)}")
    # Neither key: every captured column. One of them: the other defaults to none.
    everything = "layers" not in value and "points" not in value
    layers = value.get("layers", list(limits.captured_layers) if everything else [])
    if (not isinstance(layers, list) or any(isinstance(k, bool) or not isinstance(k, int) for k in layers)
            or (not layers and "points" not in value)):
        raise BadUncertaintyRequest(f"'uncertainty.rows.layers' must be a non-empty list of integers, got {layers!r}")
    missing = [k for k in layers if k not in limits.captured_layers]
    if missing:
        raise BadUncertaintyRequest(
            f"layer(s) {missing} are not captured by this server; captured layers: "
            f"{list(limits.captured_layers)} (start the server with --layers to capture others)")
    if len(set(layers)) != len(layers):
        raise BadUncertaintyRequest(f"'uncertainty.rows.layers' has duplicates: {layers}")
    points = _parse_points(value.get("points", list(limits.captured_points) if everything else []), limits)
    if not layers and not points:
        raise BadUncertaintyRequest("'uncertainty.rows' asks for no column: name layers or points")
    dtype = value.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
        raise BadUncertaintyRequest(f"'uncertainty.rows.dtype' must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    return RowsSpec(tuple(int(k) for k in layers), dtype, points)


def _parse_points(value: Any, limits: ServerLimits) -> tuple[Site, ...]:
    """``["mlp_out.14", ...]`` (or ``[["mlp_out", 14], ...]`` pairs; aliases ``pre_attn`` /
    ``post_attn``) as canonical sites, each captured by this server."""
    captured = [site_name(s) for s in limits.captured_points]
    if not isinstance(value, list):
        raise BadUncertaintyRequest(f"'uncertainty.rows.points' must be a list like [\"mlp_out.1\"] "
                                    f"(point.layer), got {value!r}")
    try:
        points = parse_sites(value)
    except ValueError as exc:
        raise BadUncertaintyRequest(f"'uncertainty.rows.points': {exc}") from None
    missing = [site_name(s) for s in points if s not in limits.captured_points]
    if missing:
        raise BadUncertaintyRequest(
            f"point(s) {missing} are not captured by this server; captured points: {captured or 'none'} "
            "(start the server with --points to capture others)")
    return points


def check_row_budget(spec: UncertaintySpec, num_sequences: int, max_tokens: int | None, hidden_size: int) -> None:
    """Refuse before generating when the generated rows alone would exceed the request's budget."""
    if spec.rows is None:
        return
    columns = spec.rows.num_columns
    per_token = columns * hidden_size * spec.rows.bytes_per_value
    if max_tokens is None:
        raise BadUncertaintyRequest("asking for rows needs max_tokens (max_completion_tokens), so the "
                                    "byte budget can be checked before generating")
    least = num_sequences * max_tokens * per_token
    if least > spec.max_bytes:
        raise BadUncertaintyRequest(
            f"rows budget exceeded: {num_sequences} sequence(s) x {max_tokens} tokens x "
            f"{columns} column(s) (layers and points) x {hidden_size} x {spec.rows.bytes_per_value} bytes "
            f"= {least} bytes > max_bytes {spec.max_bytes}; ask for fewer layers, points or tokens, "
            "bfloat16, or a larger max_bytes")


def row_bytes(spec: UncertaintySpec, hidden_size: int) -> int:
    """Bytes of one returned row (its layer and point columns), 0 when no rows are asked for."""
    return spec.rows.num_columns * hidden_size * spec.rows.bytes_per_value if spec.rows else 0


def parse_steer(value: Any, xargs: dict | None, steering: bool, num_layers: int, hidden_size: int,
                model_dtype: Any = None) -> Any:
    """The request's steering spec (a :class:`~uhead_vllm.capture.steering.SteerSpec`, or None):
    the body field ``steer`` or ``vllm_xargs["uhead_steer"]`` — the same terms as
    ``SamplingParams.extra_args["uhead_steer"]`` — checked against the model, and bounded
    (:data:`MAX_STEER_NORM`) so finite numbers cannot overflow its ``model_dtype`` arithmetic.

    ``"generated"`` is refused here: a steered request gets a ``cache_salt`` from its spec, and
    "generated" steers other positions for every prompt length (a later request whose prompt
    holds an earlier answer would reuse steered KV for positions it does not steer); the server
    does not know the prompt length before vLLM renders the prompt."""
    from ..capture.steering import STEER_KEY, SteerSpec, SteerSpecError

    direct = (xargs or {}).get(STEER_KEY)
    if value is not None and direct is not None:
        raise BadUncertaintyRequest(f"give steering once: the 'steer' field or vllm_xargs['{STEER_KEY}']")
    value = value if value is not None else direct
    if value is None:
        return None
    if not steering:
        raise BadUncertaintyRequest("this server was started without steering: start it with "
                                    "`uhead-vllm serve --steering` (eager engines only)")
    try:
        spec = SteerSpec.from_extra_args({STEER_KEY: value})
        assert spec is not None  # value is not None
        spec.check(num_layers, hidden_size)
    except (SteerSpecError, OverflowError) as exc:  # OverflowError: an integer too large for a float
        raise BadUncertaintyRequest(f"steer: {exc}") from None
    _check_steer_size(spec, model_dtype)
    if spec.uses_prompt_length:
        raise BadUncertaintyRequest("steer: tokens 'generated' is not served (its cache salt would depend on "
                                    "the prompt length, which the server learns only after vLLM renders the "
                                    "prompt); give the first steered position as a number, or 'all'")
    return spec


def _check_steer_size(spec: Any, model_dtype: Any) -> None:
    """Refuse steering whose additions at one site exceed :data:`MAX_STEER_NORM`."""
    import torch

    limit = math.sqrt(torch.finfo(torch.float16).max) if model_dtype == torch.float16 else MAX_STEER_NORM
    sites: dict[tuple[str, int], float] = {}
    for t in spec.terms:
        norm = abs(t.scale) * math.sqrt(math.fsum(x * x for x in t.vector)) if math.isfinite(t.scale) else math.inf
        sites[(t.point, t.layer)] = sites.get((t.point, t.layer), 0.0) + norm
    for (point, layer), total in sites.items():
        if not total <= limit:  # also catches inf and NaN (x * x can overflow a float)
            raise BadUncertaintyRequest(
                f"steer: the terms at {point}.{layer} add a vector of norm {total:.3g} (|scale| x ||vector||), more "
                f"than this server's limit {limit:.3g}: such states overflow the model's arithmetic (inf / NaN)")


def reserved_keys(xargs: dict, allowed: tuple[str, ...] = ()) -> list[str]:
    """Keys of ``xargs`` reserved for the server (:data:`RESERVED_XARGS_PREFIX`), but ``allowed``."""
    return sorted(str(k) for k in xargs if str(k).lower().startswith(RESERVED_XARGS_PREFIX) and k not in allowed)


def check_user_xargs(xargs: dict | None) -> None:
    """Refuse client ``vllm_xargs`` keys reserved for the server (``uhead_steer`` is checked by
    :func:`parse_steer`)."""
    from ..capture.steering import STEER_KEY

    bad = reserved_keys(xargs or {}, allowed=(STEER_KEY,))
    if bad:
        raise BadUncertaintyRequest(f"vllm_xargs keys {bad} are reserved for the uncertainty server (it writes "
                                    "capture tags itself; steering goes in a 'steer' field)")
