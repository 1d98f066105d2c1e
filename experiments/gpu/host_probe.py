"""How busy a lent GPU host's CPUs are, in ~10 s, before a benchmark spends minutes on it.

A SmolLM2 step is host-bound, so a benchmark is only as steady as the host's cores: on session
21's five H100 hosts plain vLLM at 256 sequences took 0.80-1.32 s, where a quiet host takes
≤ 0.70 s, and that was only seen after a 6-minute run. This times one fixed single-threaded
Python workload on each core (pinned, one core at a time, ``--reps`` times), and reads the
kernel's counters over the probe: CPU time stolen by the hypervisor (``steal`` in /proc/stat),
load average, the cores' current clock where the kernel reports it, and which cores are SMT
siblings of one physical core. Writes ``host-probe.json``
to ``--out`` and prints one line per core and a summary; the numbers are for comparing hosts
(stored next to each benchmark), not a pass/fail test.

    python -m experiments.gpu.host_probe --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def _work(n: int = 200_000) -> int:
    """A fixed interpreter-bound loop (dict and integer work, like an engine step's Python)."""
    d: dict[int, int] = {}
    s = 0
    for i in range(n):
        d[i & 1023] = i
        s += d.get((i * 7) & 1023, 0) & 0xFF
    return s


def cpu_list(text: str) -> list[int]:
    """A kernel CPU list ("0,8", "0-1", "3") as ids."""
    ids: list[int] = []
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            ids += range(int(a), int(b or a) + 1)
    return ids


def physical_cores(cores: list[int], siblings: dict[int, str] | None = None) -> list[list[int]]:
    """``cores`` grouped by physical core, SMT siblings together (``siblings``: each core's
    ``thread_siblings_list``, read from /sys when not given), ordered by their first id."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for c in cores:
        text = siblings.get(c, str(c)) if siblings is not None else _siblings_text(c)
        groups.setdefault(tuple(sorted(cpu_list(text))), []).append(c)
    return sorted(groups.values(), key=min)


def _siblings_text(core: int) -> str:
    try:
        return Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list").read_text()
    except OSError:
        return str(core)


def _stat() -> list[int]:
    """The aggregate ``cpu`` line of /proc/stat: user nice system idle iowait irq softirq steal ..."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _clock_mhz() -> list[float]:
    try:
        with open("/proc/cpuinfo") as f:
            return [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    except OSError:
        return []


def core_times(cores: list[int], reps: int) -> dict[int, list[float]]:
    """Seconds of ``reps`` runs of the fixed workload on each core, this process pinned to one core
    at a time (its affinity is restored after)."""
    allowed = os.sched_getaffinity(0)
    per_core: dict[int, list[float]] = {}
    try:
        for core in cores:
            os.sched_setaffinity(0, {core})
            _work(20_000)  # settle on the core
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                _work()
                times.append(time.perf_counter() - start)
            per_core[core] = times
    finally:
        os.sched_setaffinity(0, allowed)
    return per_core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    before, t0 = _stat(), time.time()
    per_core = core_times(cores, args.reps)
    after, seconds = _stat(), time.time() - t0
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta) or 1
    steal = delta[7] / total if len(delta) > 7 else 0.0
    medians = {c: statistics.median(t) * 1e3 for c, t in per_core.items()}
    spread = {c: (max(t) - min(t)) / min(t) for c, t in per_core.items()}
    result = {"cores": cores, "physical_cores": physical_cores(cores), "reps": args.reps, "seconds": seconds, "loadavg": os.getloadavg(),
              "steal_fraction": steal, "clock_mhz": _clock_mhz(),
              "work_ms_median_per_core": medians, "work_spread_per_core": spread,
              "work_ms_median_all": statistics.median(medians.values()),
              "work_ms_slowest_core": max(medians.values()), "commit": os.environ.get("UHEAD_COMMIT", "")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host-probe.json").write_text(json.dumps(result, indent=1))
    for c in cores:
        print(f"[probe] core {c}: {medians[c]:.1f} ms (spread {100 * spread[c]:.0f}%)")
    print(f"[probe] {len(cores)} cores on {len(result['physical_cores'])} physical cores: work {result['work_ms_median_all']:.1f} ms median, slowest core "
          f"{result['work_ms_slowest_core']:.1f} ms; steal {100 * steal:.1f}% of CPU time; "
          f"load {result['loadavg'][0]:.2f}; {seconds:.1f} s")


if __name__ == "__main__":
    main()
