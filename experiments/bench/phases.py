"""Wall-clock timers around the generator's phases, for the benchmarks that split its host time
(``bench_gpu --paired`` on the GPU host). Timers, not cProfile: cProfile
inflates the many small calls of this work 2-5x."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

GENERATOR_PHASES = ("_pretokenized", "_destination", "_sequences", "_place_first_pass", "_recompute_missing",
                    "_result")


def timed(times: dict[str, list[float]], label: str, f: Callable) -> Callable:
    """``f``, adding each call's seconds to ``times[label]``."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            times.setdefault(label, []).append(time.perf_counter() - start)
    return wrapper


def time_generator_phases(gen: Any, times: dict[str, list[float]]) -> None:
    """Time ``gen``'s phases into ``times``: its own methods, the fetch (sending it, and waiting
    for the answer after the work done meanwhile), the destination's hand-over and the row store."""
    for name in GENERATOR_PHASES:
        setattr(gen, name, timed(times, name, getattr(gen, name)))
    fetch_later = timed(times, "fetch (sent)", gen.client.fetch_later)
    gen.client.fetch_later = lambda: timed(times, "fetch (waiting for the answer)", fetch_later())
    gen.client.fetch = timed(times, "fetch (RPC)", gen.client.fetch)
    gen.client.place_into = timed(times, "place_into (sent, in _destination)", gen.client.place_into)
    gen.store.put = timed(times, "store.put", gen.store.put)
    gen.store.keys = timed(times, "store.keys", gen.store.keys)
