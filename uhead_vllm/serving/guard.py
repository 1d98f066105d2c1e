"""Checks of every client request body, on every route, before vLLM reads it.

The engine side reads a few ``SamplingParams.extra_args`` keys (capture tags, the server's marks,
steering). vLLM forwards a client's ``vllm_xargs`` or ``extra_args`` into them on many routes
(Responses, Anthropic Messages, batch chat, tokens-in generate, transcription, ...), so those
keys are refused in every body: a forged tag could take another request's rows. ``uhead_steer`` is
accepted only on the two routes that check and salt it, and the ``uncertainty`` / ``steer``
fields are refused where nothing would serve them instead of being silently ignored. (The
engine's gate, :func:`uhead_vllm.adapters.server.install_engine_gate`, refuses what slips past.)
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from ..capture.steering import STEER_KEY
from .spec import reserved_keys

#: The routes whose handlers serve ``uncertainty`` and ``steer`` (and check ``uhead_steer``).
SCORING_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
#: Request fields vLLM turns into ``SamplingParams.extra_args`` (at any depth:
#: ``sampling_params.extra_args`` of the tokens-in route; a JSON string in form bodies).
XARGS_FIELDS = frozenset({"vllm_xargs", "extra_args"})
SERVED_FIELDS = ("uncertainty", "steer")
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


def refusal(path: str, body: Any) -> str | None:
    """Why this parsed request body must be refused (HTTP 400), None when it may go on."""
    scoring = path in SCORING_ROUTES
    if isinstance(body, dict) and not scoring:
        asked = [f for f in SERVED_FIELDS if body.get(f) not in (None, False)]
        if asked:
            return (f"{' and '.join(repr(f) for f in asked)} is served on {' and '.join(sorted(SCORING_ROUTES))} "
                    f"only; {path} cannot serve it")
    allowed = (STEER_KEY,) if scoring else ()
    for field, xargs in _xargs(body):
        bad = reserved_keys(xargs, allowed)
        if bad:
            why = ("steering is served on " + " and ".join(sorted(SCORING_ROUTES)) + " only"
                   if STEER_KEY in bad else "it writes capture tags itself")
            return f"{field} keys {bad} are reserved for the uncertainty server: {why}"
    return None


def _xargs(body: Any) -> Iterator[tuple[str, dict]]:
    """Every ``vllm_xargs`` / ``extra_args`` object in ``body``, at any depth (iteratively: a deep
    body cannot exhaust the stack)."""
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in XARGS_FIELDS:
                    parsed = _json_object(value)
                    if parsed is not None:
                        yield key, parsed
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def _json_object(value: Any) -> dict | None:
    if isinstance(value, dict):
        return value
    if isinstance(value, (str, bytes)):  # form fields carry it as a JSON string (vLLM parses it)
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return None
        return parsed if isinstance(parsed, dict) else None
    return None


def parse_body(content_type: str, body: bytes) -> Any:
    """The body as vLLM will read it: JSON (as Starlette's ``json.loads``) unless it is a form
    (then see :func:`form_fields`); None when it is neither."""
    if content_type.split(";")[0].strip().lower() in FORM_TYPES or not body:
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None  # vLLM answers its own error
