"""vLLM's ``EngineArgs`` and plugin allowlist (checked against vLLM 0.26 and 0.32): a hook that
fills in arguments before every engine configuration this process creates.

The vLLM plugin form of the server (``uhead_vllm.serving.plugin``) has no command line of its own:
plain ``vllm serve`` parses its arguments, then builds its engine configuration from them with
``EngineArgs.create_engine_config``; that is where capture's worker extension and settings join.
"""

from __future__ import annotations

from typing import Any, Callable


def fill_before_config(fill: Callable[[Any], None]) -> None:
    """Call ``fill(engine_args)`` at the start of every ``EngineArgs.create_engine_config`` in this
    process (idempotent: a second call keeps the first ``fill``)."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, "_uhead_fill", None) is not None:
        return
    original = EngineArgs.create_engine_config

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        fill(self)
        return original(self, *args, **kwargs)

    EngineArgs.create_engine_config = create_engine_config
    EngineArgs._uhead_fill = fill


def plugin_allowlisted(name: str) -> bool:
    """True where vLLM's ``VLLM_PLUGINS`` names ``name`` (unset, vLLM loads every general plugin)."""
    import vllm.envs

    return name in (vllm.envs.VLLM_PLUGINS or [])
