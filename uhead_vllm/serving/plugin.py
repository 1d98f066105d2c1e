"""uhead_vllm as a vLLM plugin: ``VLLM_PLUGINS=uhead_vllm vllm serve MODEL`` is ``uhead-vllm serve``.

Two entry points (``pyproject.toml``), both named ``uhead_vllm`` and both switched on by naming
them in vLLM's own allowlist ``VLLM_PLUGINS`` (endpoint plugins load only when named there):

- ``vllm.general_plugins`` -> :func:`register`: every engine the server builds gets capture's
  worker extension and settings (``additional_config["uhead_vllm"]``; when absent, the shipped
  head's layers in bf16), unless the user set them.
- ``vllm.endpoint_plugins`` -> :class:`UncertaintyEndpoints`: the uncertainty middleware on vLLM's
  app (scores in the OpenAI responses, the web page, ``/uhead/status``, ``/uhead/info``).

The server's own options (head directory or ``none``, byte limits, ``"scores_on_device": true`` as
``uhead-vllm serve --scores-on-device``) travel in ``--additional-config '{"uhead_vllm_serve": {...}}'``
as with the three-flag form. The defaults are
vLLM's, on every platform; ``uhead-vllm serve`` adds the platform-aware ones.
"""

from __future__ import annotations

from typing import Any

from ..capture.protocol import CAPTURE_KEY, EXTENSION_QUALNAME
from ..errors import InputError
from .install import SERVE_KEY

NAME = "uhead_vllm"


def enabled() -> bool:
    """True where vLLM's ``VLLM_PLUGINS`` names this plugin (vLLM loads general plugins by default;
    this one changes nothing unless asked for by name)."""
    from ..adapters.engine_args import plugin_allowlisted

    return plugin_allowlisted(NAME)


def register() -> None:
    """``vllm.general_plugins`` entry point (runs in every vLLM process; only the server's process
    builds engine configurations)."""
    if not enabled():
        return
    from ..adapters.engine_args import fill_before_config

    fill_before_config(add_capture)


def add_capture(engine_args: Any) -> None:
    """Give ``engine_args`` capture's worker extension and settings unless the user set them."""
    from .launch import capture_settings

    ext = engine_args.worker_extension_cls
    if ext and ext != EXTENSION_QUALNAME:
        raise InputError(f"VLLM_PLUGINS names {NAME}, which needs --worker-extension-cls {EXTENSION_QUALNAME}; "
                         f"this server was given {ext}")
    engine_args.worker_extension_cls = EXTENSION_QUALNAME
    extra = dict(engine_args.additional_config or {})
    if CAPTURE_KEY not in extra:
        serve = extra.get(SERVE_KEY) or {}
        extra[CAPTURE_KEY] = capture_settings(str(engine_args.model), serve.get("head"), None,
                                              scores_on_device=bool(serve.get("scores_on_device", False))).to_dict()
    engine_args.additional_config = extra


class UncertaintyEndpoints:
    """``vllm.endpoint_plugins`` entry point: vLLM's ``EndpointPlugin`` protocol."""

    name = NAME
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from .middleware import UncertaintyMiddleware

        app.add_middleware(UncertaintyMiddleware)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Nothing here: the middleware installs the service at the app's start-up, as with ``--middleware``."""
