"""Capture backends (engine side): one module per backend, one registry.

A new backend is a module here implementing :class:`~.base.CaptureBackend` and one entry in
:data:`BACKENDS`; ``build_llm(backend=...)`` and the generator find it through this registry.
"""

from __future__ import annotations

from typing import Any

from .aux import AUX, AuxClient, CaptureNotInstalledError, capture_engine_kwargs
from .base import CaptureBackend, CaptureClient, Placement, raise_if_engine_dead
from .extract import EXTRACT, ExtractClient

#: Backends by name; ``aux`` is the default.
BACKENDS: dict[str, CaptureBackend] = {b.name: b for b in (AUX, EXTRACT)}


def get_backend(name: str) -> CaptureBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown capture backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]


def open_capture_client(llm: Any) -> CaptureClient:
    """The client of the backend ``llm`` was built with; the aux client (which explains how to
    install capture) when no backend claims it."""
    for backend in BACKENDS.values():
        if backend is not AUX and backend.owns(llm):
            return backend.open_client(llm)
    return AUX.open_client(llm)


__all__ = ["BACKENDS", "AuxClient", "CaptureBackend", "CaptureClient", "CaptureNotInstalledError",
           "ExtractClient", "Placement", "capture_engine_kwargs", "get_backend", "open_capture_client",
           "raise_if_engine_dead"]
