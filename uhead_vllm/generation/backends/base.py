"""The interface every capture backend implements (engine side).

A backend says how a capturing engine is built (``engine_kwargs`` merged into ``vllm.LLM``),
whether an existing engine was built by it (``owns``) and how rows come back (``open_client``).
Every client returns the same :class:`~uhead_vllm.capture.protocol.CapturedRows`, so the generator
never knows which backend it talks to.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

from ...capture.protocol import CapturedRows, CaptureSettings


class CaptureClient(Protocol):
    """Engine-side handle on one engine's capture: its settings, and rows since the last fetch."""

    settings: CaptureSettings

    def fetch(self) -> CapturedRows: ...


class CaptureBackend(Protocol):
    name: str

    def engine_kwargs(self, layers: Iterable[int], *, capture_dtype: str, max_capture_bytes: int,
                      capture_dir: str | None) -> dict[str, Any]:
        """``vllm.LLM`` keyword arguments that install this backend (refuses unsupported set-ups)."""

    def owns(self, llm: Any) -> bool:
        """True when ``llm`` was built with this backend's ``engine_kwargs``."""

    def open_client(self, llm: Any) -> CaptureClient:
        """The client that fetches ``llm``'s captured rows."""
