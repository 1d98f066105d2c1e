"""uhead_vllm as a vLLM plugin: ``VLLM_PLUGINS=uhead_vllm vllm serve MODEL`` is ``uhead-vllm serve``.

Two entry points (``pyproject.toml``), both named ``uhead_vllm`` and both switched on by naming
them in vLLM's own allowlist ``VLLM_PLUGINS`` (endpoint plugins load only when named there):

- ``vllm.general_plugins`` -> :func:`register`: every engine the server builds gets capture's
  worker extension and settings (``additional_config["uhead_vllm"]``, checked; when absent, the
  head's layers in bf16).
- ``vllm.endpoint_plugins`` -> :class:`UncertaintyEndpoints`: the uncertainty middleware on vLLM's
  app (scores in the OpenAI responses, the web page, ``/uhead/status``, ``/uhead/info``).

The server's own options (head directory or ``none``, byte limits, ``"scores_on_device": true`` as
``uhead-vllm serve --scores-on-device``) travel in ``--additional-config '{"uhead_vllm_serve": {...}}'``
as with the three-flag form. The defaults are
vLLM's, on every platform; ``uhead-vllm serve`` adds the platform-aware ones.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..capture.protocol import CAPTURE_KEY, EXTENSION_QUALNAME, CaptureSettings
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


#: Keys of ``additional_config["uhead_vllm"]`` in the plugin form (``uhead-vllm serve``'s
#: ``--layers``, ``--capture-dtype``, ``--points``, ``--steering``; ``max_bytes``: the worker's cap).
CAPTURE_KEYS = ("layers", "dtype", "points", "steering", "max_bytes")


def add_capture(engine_args: Any) -> None:
    """Give ``engine_args`` capture's worker extension and settings: the user's
    ``additional_config["uhead_vllm"]``, checked as ``uhead-vllm serve`` checks its flags, else
    the head's layers in bf16."""
    ext = engine_args.worker_extension_cls
    if ext and ext != EXTENSION_QUALNAME:
        raise InputError(f"VLLM_PLUGINS names {NAME}, which needs --worker-extension-cls {EXTENSION_QUALNAME}; "
                         f"this server was given {ext}")
    engine_args.worker_extension_cls = EXTENSION_QUALNAME
    extra = dict(engine_args.additional_config or {})
    serve = extra.get(SERVE_KEY) or {}
    given = extra.get(CAPTURE_KEY)
    if isinstance(given, dict) and "token_inputs" in given:  # built here before (another process of vLLM's)
        settings = CaptureSettings.from_dict(given)
    elif serve.get("scores_on_device"):
        from .launch import capture_settings

        if given is not None:
            raise InputError(f"{SERVE_KEY}.scores_on_device captures the head's layers reduced by its inputs: drop "
                             f"additional_config[{CAPTURE_KEY!r}]")
        settings = capture_settings(str(engine_args.model), serve.get("head"), None, scores_on_device=True)
    else:
        settings = plugin_capture_settings(str(engine_args.model), serve.get("head"), given)
    if (settings.points or settings.steering) and not engine_args.enforce_eager:
        raise InputError(f"{CAPTURE_KEY} points and steering are forward hooks on decoder submodules, which never "
                         "fire in a compiled model: add --enforce-eager")
    extra[CAPTURE_KEY] = settings.to_dict()
    engine_args.additional_config = extra


def plugin_capture_settings(model: str, head: str | None, given: Any) -> CaptureSettings:
    """Capture settings from ``additional_config["uhead_vllm"]`` (None: the head's layers):
    ``{"layers": [...], "dtype": "bfloat16", "points": ["mlp_out.14", ...], "steering": false}``;
    points as ``"point.layer"`` strings or ``[point, layer]`` pairs."""
    from .launch import capture_settings

    if given is None:
        return capture_settings(model, head, None)
    if not isinstance(given, dict) or set(given) - set(CAPTURE_KEYS):
        raise InputError(f"additional_config[{CAPTURE_KEY!r}] must be an object with keys among {list(CAPTURE_KEYS)}, "
                         f"got {given!r}")
    points = [p if isinstance(p, str) else ".".join(map(str, p)) for p in given.get("points") or []]
    try:
        settings = capture_settings(model, head, given.get("layers"), given.get("dtype", "bfloat16"), points,
                                    bool(given.get("steering", False)))
        return replace(settings, max_bytes=int(given["max_bytes"])) if "max_bytes" in given else settings
    except (TypeError, ValueError) as exc:
        raise InputError(f"additional_config[{CAPTURE_KEY!r}]: {exc}") from None


class UncertaintyEndpoints:
    """``vllm.endpoint_plugins`` entry point: vLLM's ``EndpointPlugin`` protocol."""

    name = NAME
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from .middleware import UncertaintyMiddleware

        app.add_middleware(UncertaintyMiddleware)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Nothing here: the middleware installs the service at the app's start-up, as with ``--middleware``."""
