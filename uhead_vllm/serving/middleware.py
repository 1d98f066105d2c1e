"""ASGI middleware that turns vLLM's own OpenAI server into an uncertainty server.

Load it with vLLM's ``--middleware uhead_vllm.serving.UncertaintyMiddleware``. At start-up
(the ASGI lifespan, after vLLM has built its handlers) it installs the service
(:func:`install`); it also serves the small web page at ``/`` and ``GET /uhead/status``
(memory and counters) and ``GET /uhead/info`` (model, head, layers and points, the head's prompt).
Every other request passes through untouched.
"""

from __future__ import annotations

import logging
from importlib.resources import files
from typing import Any

from ..capture.points import site_name
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
        return await self.app(scope, receive, send)


async def _page(service: Any) -> Any:
    from starlette.responses import HTMLResponse

    return HTMLResponse(files("uhead_vllm.serving").joinpath("page.html").read_text())


async def _status(service: Any) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(await service.status())


async def _info(service: Any) -> Any:
    from starlette.responses import JSONResponse

    scorer = service.scorer
    info = {"head": service.limits.head_name, "captured_layers": list(service.settings.layers),
            "captured_points": [site_name(s) for s in service.settings.points],
            "hidden_size": service.hidden_size, "max_rows_bytes": service.limits.max_rows_bytes}
    if scorer is not None:
        chat = scorer.recipe.chat("{question}")
        info.update(prompt_template=chat[-1]["content"], max_tokens=scorer.recipe.max_tokens,
                    split_mode=scorer.recipe.split_mode, head_layers=list(scorer.head.recipe.layers))
    return JSONResponse(info)


_ROUTES = {"/": _page, "/uhead/status": _status, "/uhead/info": _info}
