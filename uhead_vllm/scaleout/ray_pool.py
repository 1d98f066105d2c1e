"""Work units on a pool of Ray actors, each holding one capturing engine.

A job is a JSON-able description plus a *worker class*: ``Worker(job)`` builds the engine once
(per actor), ``worker.run(unit)`` does unit ``unit`` and returns a small JSON-able summary; the
rows themselves go to files the worker writes (safetensors on storage every actor sees), never
through Ray. What crosses the actor boundary is a unit number in and a JSON string out (Ray's own
RPC frames them; the cluster must be trusted, as for any Ray job).

Each actor has one unit in flight; when a unit ends the actor gets the next one. An actor that
dies (killed, out of memory, node lost) is replaced in its slot and the unit it held is queued
again — the worker writes units atomically, so a redone unit replaces whatever the dead actor
left. A unit whose actor died ``max_attempts`` times fails the run (the finished units stay and a
new run resumes from them). An exception raised by the worker's own code is not retried: it is a
bug or bad input, re-raised as it is.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import require

#: Ray namespace of the engine actors (``ray.util.list_named_actors(all_namespaces=True)``).
NAMESPACE = "uhead_vllm"


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide: ``address`` None starts a local Ray cluster for the run (and stops it
    after), else connects (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``). One engine per
    replica; ``gpus_per_replica`` > 1 is for a tensor-parallel engine inside the actor."""

    address: str | None = None
    replicas: int = 2
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    max_attempts: int = 3

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_attempts < 1:
            raise ValueError("replicas and max_attempts must be >= 1")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ValueError("cpus_per_replica and gpus_per_replica must be >= 0")


@dataclass
class PoolStats:
    """What happened in one run of the pool (for logs and results files, not for the data)."""

    replicas: int
    units: int = 0
    actors_started: int = 0
    actors_replaced: int = 0
    units_retried: int = 0
    seconds: float = 0.0
    summaries: list[dict[str, Any]] = field(default_factory=list)


class _Replica:
    """The actor: imports the worker class by name and keeps one instance (one engine)."""

    def __init__(self, worker: str, job_json: str):
        import importlib

        module, _, name = worker.partition(":")
        self.worker = getattr(importlib.import_module(module), name)(json.loads(job_json))

    def run(self, unit: int) -> str:
        return json.dumps(self.worker.run(int(unit)))


def _worker_path(worker_cls: type) -> str:
    return f"{worker_cls.__module__}:{worker_cls.__qualname__}"


def _check_resources(ray: Any, options: RayOptions) -> None:
    """Refuse at once what the cluster can never place (instead of actors pending forever)."""
    have = ray.cluster_resources()
    for key, per in (("CPU", options.cpus_per_replica), ("GPU", options.gpus_per_replica)):
        if per and have.get(key, 0) < per:
            raise ValueError(f"the Ray cluster has {have.get(key, 0):g} {key}(s); one replica needs {per:g}")


def run_units(worker_cls: type, job: dict[str, Any], units: Sequence[int], options: RayOptions, *,
              on_done: Callable[[int, dict[str, Any]], None] = lambda unit, summary: None) -> PoolStats:
    """Run ``worker_cls(job).run(unit)`` for every unit on ``options.replicas`` actors; call
    ``on_done(unit, summary)`` in the driver as each finishes (any order)."""
    ray = require("ray", "running on Ray (--ray)")
    from ray.exceptions import RayActorError

    if not units:  # e.g. a resumed run with every unit finished: no engine to start
        return PoolStats(replicas=options.replicas)
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=options.address, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", configure_logging=True)
    t0 = time.perf_counter()
    stats = PoolStats(replicas=options.replicas)
    actors: list[Any] = []
    try:
        _check_resources(ray, options)
        replica = ray.remote(_Replica)
        shape = dict(num_cpus=options.cpus_per_replica, num_gpus=options.gpus_per_replica, max_restarts=0,
                     max_task_retries=0, namespace=NAMESPACE)
        run_id = uuid.uuid4().hex[:8]
        job_json, path = json.dumps(job), _worker_path(worker_cls)

        def start(slot: int) -> Any:
            stats.actors_started += 1
            return replica.options(name=f"uhead-{run_id}-r{slot}-{stats.actors_started}", **shape).remote(path, job_json)

        pending = deque(units)
        attempts: dict[int, int] = {}
        inflight: dict[Any, tuple[int, int]] = {}

        def submit(slot: int) -> None:
            if pending:
                unit = pending.popleft()
                inflight[actors[slot].run.remote(unit)] = (slot, unit)

        for slot in range(min(options.replicas, len(pending))):
            actors.append(start(slot))
            submit(slot)
        while inflight:
            [ref], _ = ray.wait(list(inflight), num_returns=1)
            slot, unit = inflight.pop(ref)
            try:
                summary = json.loads(ray.get(ref))
            except RayActorError as e:
                attempts[unit] = attempts.get(unit, 0) + 1
                if attempts[unit] >= options.max_attempts:
                    raise RuntimeError(f"unit {unit}: its engine actor died {attempts[unit]} times; last: "
                                       f"{' '.join(str(e).split())[:600]}") from e
                ray.kill(actors[slot], no_restart=True)
                actors[slot] = start(slot)
                stats.actors_replaced += 1
                stats.units_retried += 1
                pending.appendleft(unit)
                submit(slot)
                continue
            except ray.exceptions.RayTaskError as e:
                raise e.as_instanceof_cause() from None
            stats.units += 1
            stats.summaries.append(summary)
            on_done(unit, summary)
            submit(slot)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        stats.seconds = time.perf_counter() - t0
        if started_here:
            ray.shutdown()
    return stats
