"""Rows taken from the worker for many requests at once: one take in flight at a time.

Every take is a ``collective_rpc`` the engine core serves between its steps, so a take per
request per step (a streamed request fetches at each step end) stalls the engine once per
request: at concurrency 64 the RPCs, not the model, set the pace. Here a caller that asks while
a take runs joins the next one, so there is at most one take in flight and one per engine step
or so, whatever the concurrency.

Each waiter's ``use`` runs on the taken rows inside the queue, before the next take starts: rows
may sit in a shared-memory file that the next take writes into, so a waiter copies what it keeps
(``RequestRecord.add_rows``) before the file can be reused.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

from ..capture.protocol import CapturedRows

T = TypeVar("T")
Take = Callable[[list[int], bool, int], Awaitable[CapturedRows]]


class TakeQueue:
    """Coalesces takes of one kind (``forget`` or not) into one RPC per round."""

    def __init__(self, take: Take, forget: bool):
        self._take = take
        self._forget = forget
        self._waiting: list[tuple[list[int], int, Callable[[CapturedRows], Any], asyncio.Future]] = []
        self._running: asyncio.Future | None = None
        self.rounds = 0  # RPCs made (for /uhead/status: rounds vs callers shows the coalescing)
        self.callers = 0

    async def take(self, tags: list[int], expect_rows: int, use: Callable[[CapturedRows], T]) -> T:
        """``use(rows)`` of a take that includes ``tags`` (the rows may include other callers'
        tags: ``use`` keeps its own). ``expect_rows``: this caller's share of the rows to expect."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting.append(([int(t) for t in tags], int(expect_rows), use, future))
        self.callers += 1
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            batch = [b for b in batch if not b[3].done()]  # a caller that left (cancelled) takes nothing
            if not batch:
                continue
            tags = sorted({t for b in batch for t in b[0]})
            self.rounds += 1
            try:
                rows = await self._take(tags, self._forget, sum(b[1] for b in batch))
            except asyncio.CancelledError:
                for *_, future in batch:
                    future.cancel()
                raise
            except Exception as exc:  # the engine died or the take failed: every waiter hears it
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for _, _, use, future in batch:
                if future.done():
                    continue
                try:
                    future.set_result(use(rows))
                except Exception as exc:
                    future.set_exception(exc)
