"""Capture backends (engine side): one module per backend, one registry, one client per engine.

A new backend is a module here implementing :class:`~.base.CaptureBackend` and one entry in
:data:`BACKENDS`; ``build_llm(backend=...)`` and the generator find it through this registry.
:func:`make_capture_client` chooses an engine's client once (backend, and for the ``aux`` backend
its transport: in this process or to an engine core in another; sync for ``vllm.LLM``, async for
``AsyncLLM``), as vLLM's ``EngineCoreClient.make_client`` does, and keeps it for the engine's life.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any

from .aux import AUX, AsyncAuxClient, AuxClient, CaptureNotInstalledError, capture_engine_kwargs
from .base import AsyncCaptureClient, CaptureBackend, CaptureClient, Placement, check_engine_alive, raise_if_engine_dead
from .extract import EXTRACT, ExtractClient

#: Backends by name; ``aux`` is the default.
BACKENDS: dict[str, CaptureBackend] = {b.name: b for b in (AUX, EXTRACT)}

_CLIENTS: "weakref.WeakKeyDictionary[Any, CaptureClient | AsyncCaptureClient]" = weakref.WeakKeyDictionary()
_CLIENTS_GUARD = threading.Lock()


def get_backend(name: str) -> CaptureBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown capture backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]


def make_capture_client(engine: Any) -> CaptureClient | AsyncCaptureClient:
    """The capture client of ``engine``, made at the first call and the same one after.

    A ``vllm.LLM`` gets the client of the backend it was built with (the aux client, which
    explains how to install capture, when no backend claims it), with the sync face the
    generator uses (:class:`~.base.CaptureClient`). vLLM's ``AsyncLLM`` (the API server) gets
    :class:`~.aux.AsyncAuxClient`, the async face (:class:`~.base.AsyncCaptureClient`). Clients
    hold their engine weakly: the cache never keeps an engine alive. Raises
    :class:`~uhead_vllm.errors.EngineDeadError` for an engine vLLM marked dead (a client made
    earlier is no use then, and the caller should not learn it only at its first request)."""
    with _CLIENTS_GUARD:
        client = _CLIENTS.get(engine)
        if client is None:
            client = _CLIENTS[engine] = _new_client(engine)
        else:
            check_engine_alive(engine)
        return client


def _new_client(engine: Any) -> CaptureClient | AsyncCaptureClient:
    if inspect.iscoroutinefunction(getattr(engine, "collective_rpc", None)):
        return AsyncAuxClient(engine)
    for backend in BACKENDS.values():
        if backend is not AUX and backend.owns(engine):
            return backend.open_client(engine)
    return AUX.open_client(engine)


#: The name the generator knows (one client per engine now, made by :func:`make_capture_client`).
open_capture_client = make_capture_client

__all__ = ["BACKENDS", "AsyncAuxClient", "AsyncCaptureClient", "AuxClient", "CaptureBackend", "CaptureClient",
           "CaptureNotInstalledError", "ExtractClient", "Placement", "capture_engine_kwargs", "get_backend",
           "make_capture_client", "open_capture_client", "raise_if_engine_dead"]
