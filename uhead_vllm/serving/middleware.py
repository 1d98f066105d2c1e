"""ASGI middleware that turns vLLM's own OpenAI server into an uncertainty server.

Load it with vLLM's ``--middleware uhead_vllm.serving.UncertaintyMiddleware``. At start-up
(the ASGI lifespan, after vLLM has built its handlers) it installs the service
(:func:`install`); it also serves the small web page at ``/`` and ``GET /uhead/status``
(memory and counters) and ``GET /uhead/info`` (model, head, layers and points, the head's prompt).
Every request body is checked first (:mod:`.guard`: reserved ``extra_args`` keys, fields a route
cannot serve); what passes goes to vLLM unchanged.
"""

from __future__ import annotations

import logging
from importlib.resources import files
from typing import Any

from ..capture.points import site_name
from .guard import FORM_TYPES, parse_body, refusal
from .install import install

logger = logging.getLogger("uhead_vllm.serving")


class UncertaintyMiddleware:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            async def receive_and_install() -> dict:
                message = await receive()
                if message.get("type") == "lifespan.startup":
                    install(scope["app"].state)
                    logger.info("uhead_vllm uncertainty serving installed")
                return message

            return await self.app(scope, receive_and_install, send)
        if scope["type"] == "http":
            service = install(scope["app"].state)
            if scope["method"] == "GET":
                route = _ROUTES.get(scope["path"])
                if route is not None:
                    response = await route(service)
                    return await response(scope, receive, send)
            elif scope["method"] in ("POST", "PUT", "PATCH"):
                body = await _read_body(receive)
                if body is None:
                    return None  # the client left before sending its body
                why = await _refusal(scope, body)
                if why is not None:
                    return await _bad_request(why)(scope, receive, send)
                receive = _replay(body, receive)
        return await self.app(scope, receive, send)


async def _read_body(receive: Any) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """A receive that hands vLLM the body read here, then the client's own messages (disconnect)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refusal(scope: dict, body: bytes) -> str | None:
    path = scope["path"]
    root = scope.get("root_path") or ""
    if root and path.startswith(root):
        path = path[len(root):]
    path = path.rstrip("/") or "/"
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    content_type = headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() not in FORM_TYPES:
        return refusal(path, parse_body(content_type, body))
    from starlette.requests import Request

    form = await Request(scope, _replay(body, _no_more)).form()
    try:
        for key, value in form.multi_items():
            why = refusal(path, {key: value}) if isinstance(value, str) else None
            if why is not None:
                return why
    finally:
        await form.close()
    return None


async def _no_more() -> dict:
    return {"type": "http.disconnect"}


def _bad_request(message: str) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}},
                        status_code=400)


async def _page(service: Any) -> Any:
    from starlette.responses import HTMLResponse

    return HTMLResponse(files("uhead_vllm.serving").joinpath("page.html").read_text())


async def _status(service: Any) -> Any:
    from starlette.responses import JSONResponse

    from ..adapters.engine import is_engine_dead

    try:
        return JSONResponse(await service.status())
    except Exception as exc:  # the RPC ended with the engine core (it never hangs on a dead one)
        if not is_engine_dead(exc):
            raise
        return JSONResponse({"error": {"message": "the engine is dead", "type": "EngineDeadError", "param": None,
                                       "code": 503}}, status_code=503)


async def _info(service: Any) -> Any:
    from starlette.responses import JSONResponse

    scorer = service.scorer
    info = {"head": service.limits.head_name, "captured_layers": list(service.settings.layers),
            "captured_points": [site_name(s) for s in service.settings.points],
            "hidden_size": service.hidden_size, "max_rows_bytes": service.limits.max_rows_bytes,
            "scores_on_device": service.limits.reduced}  # rows are the head's inputs (hidden_size: their D)
    if scorer is not None:
        chat = scorer.recipe.chat("{question}")
        info.update(prompt_template=chat[-1]["content"], max_tokens=scorer.recipe.max_tokens,
                    split_mode=scorer.recipe.split_mode, head_layers=list(scorer.head.recipe.layers))
    return JSONResponse(info)


_ROUTES = {"/": _page, "/uhead/status": _status, "/uhead/info": _info}
