"""The interface every capture backend implements (engine side).

A backend says how a capturing engine is built (``engine_kwargs`` merged into ``vllm.LLM``),
whether an existing engine was built by it (``owns``) and how rows come back (``open_client``).
Every client returns the same :class:`~uhead_vllm.capture.protocol.CapturedRows`, so the generator
never knows which backend it talks to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

from ...adapters import engine as engine_internals
from ...capture.destination import RowDestination
from ...capture.protocol import CapturedRows, CaptureSettings
from ...errors import EngineDeadError


_DEAD = ("the vLLM engine is dead (its engine core failed earlier; the first error is in the log above); "
         "build a new engine")


def raise_if_engine_dead(exc: BaseException) -> None:
    """Re-raise vLLM's "engine dead" as :class:`uhead_vllm.errors.EngineDeadError`, so a crashed
    engine is reported as one (and not as a missing capture extension or a capture bug)."""
    if engine_internals.is_engine_dead(exc):
        raise EngineDeadError(_DEAD) from exc


def check_engine_alive(engine: Any) -> None:
    """:class:`uhead_vllm.errors.EngineDeadError` for an engine vLLM already marked dead."""
    if engine_internals.engine_dead(engine):
        raise EngineDeadError(_DEAD)


def live_engine(ref: Callable[[], Any]) -> Any:
    """The engine a client's weak reference names; clients hold engines weakly so that the
    per-engine client cache never keeps one alive."""
    engine = ref()
    if engine is None:
        raise EngineDeadError("this capture client's vLLM engine was garbage-collected; build a new one")
    return engine


@dataclass
class Placement:
    """Where the worker is asked to write the coming generation's rows.

    ``answer`` (when set) waits for the worker's reply to a request that was sent without waiting
    (the engine core handles its input in order, so the worker takes the destination before any
    request sent after it runs); ``settle`` is called once those requests are sent and returns the
    destination, or None where the worker declined (its rows then come back with ``fetch``)."""

    destination: RowDestination | None
    answer: Callable[[], bool] | None = None
    after: Callable[[], None] | None = None  # runs once the answer is in (or failed)

    def settle(self) -> RowDestination | None:
        if self.answer is not None:
            answer, self.answer = self.answer, None
            try:
                if not answer():
                    self.destination = None
            finally:
                if self.after is not None:
                    self.after()
        return self.destination


class CaptureClient(Protocol):
    """Engine-side handle on one engine's capture: its settings, and rows since the last fetch."""

    settings: CaptureSettings

    def place_into(self, slots: dict[int, tuple[int, int]], shape: tuple[int, int, int],
                   groups: Sequence[tuple[int, tuple[int, ...]]] = (), starts: dict[int, int] | None = None) -> Placement:
        """Start a generation: drop rows recorded before it (requests made outside the generator)
        and name a buffer the worker writes this generation's rows into while it runs
        (``slots``: request tag -> first row, capacity; ``groups``, ``starts`` (tag -> capture
        window start): see :class:`RowDestination`); its destination is None where this backend or engine cannot
        (the rows then come back with ``fetch``). Call ``settle`` after sending the requests."""

    def fetch(self) -> CapturedRows: ...

    def fetch_later(self) -> Callable[[], CapturedRows]:
        """Ask for the rows since the last fetch now; the returned call waits for them."""


class AsyncCaptureClient(Protocol):
    """Engine-side handle on an ``AsyncLLM``'s capture (the API server): concurrent requests each
    take the rows of their own tags."""

    counters: dict[str, int]  # rows_in_shared_memory, rows_as_bytes

    async def take_tags(self, tags: list[int], forget: bool = False, expect_rows: int = 0) -> CapturedRows:
        """The rows of ``tags`` recorded so far (other requests' rows stay in the worker); ``forget``
        also stops recording them (a client that went away); ``expect_rows`` (at most that many):
        through a shared-memory file."""

    async def status(self) -> dict:
        """The recording rank's status: settings, ``bytes_held``, counts of refused tags."""


class CaptureBackend(Protocol):
    name: str

    def engine_kwargs(self, layers: Iterable[int], *, capture_dtype: str, max_capture_bytes: int,
                      capture_dir: str | None, points: Iterable[Any] = (), steering: bool = False,
                      token_inputs: str = "") -> dict[str, Any]:
        """``vllm.LLM`` keyword arguments that install this backend (refuses unsupported set-ups,
        e.g. capture points, steering or token inputs where it has none)."""

    def owns(self, llm: Any) -> bool:
        """True when ``llm`` was built with this backend's ``engine_kwargs``."""

    def open_client(self, llm: Any) -> CaptureClient:
        """The client that fetches ``llm``'s captured rows."""
