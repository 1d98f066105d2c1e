"""CPU time of the processes a vLLM engine starts, read around each run of a benchmark."""

from __future__ import annotations

from typing import Any


class EngineProcesses:
    """The processes each engine started (its engine core, with the worker in it or beside it), to
    read their CPU time around each run. CPU time counts work, not waiting for a core, so on CPU it
    is far less disturbed by a busy neighbour than wall time. On a GPU an engine's CPU time follows
    its wall time: its main thread spins while it waits for the GPU (docs/gpu.md)."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self._known = {p.pid for p in self._me.children(recursive=True)}
        self._of: dict[str, list[Any]] = {}

    def note(self, name: str) -> list[int]:
        """The processes started since the last call are engine ``name``'s; returns their pids."""
        new = [p for p in self._me.children(recursive=True) if p.pid not in self._known]
        self._known.update(p.pid for p in new)
        self._of[name] = new
        return [p.pid for p in new]

    def cpu_seconds(self, name: str) -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in self._of[name]))
