"""Does the placer thread slow the engine's thread? ``python -m experiments.bench.placer_beside_engine``.

On a GPU the worker's placer thread scatters each batch of 16 decode steps into the row file while
vLLM's engine loop (Python-bound for a small model) runs in the same process; on the H100 host its
wall time was 74 ms per call at 256 sequences (SmolLM2 shape), the first suspect for capture time
not yet attributed. Here a Python-bound loop (a dict walk, like a scheduler's) runs for a fixed time
beside a thread that places one such batch (256 requests x 16 steps x 3 layers x 576 bf16, into a
256 x 190-row destination) every 80 ms (16 steps of ~5 ms), by what that thread does: the real
``place_step``, only its one big numpy copy, torch's ``index_copy_``, or nothing (sleeping).
Rounds alternate the variants with the loop alone; each variant's ratio is the loop's iterations
over those of the alone runs next to it, median over rounds.

Writes ``experiments/results/bench/placer_beside_engine.{json,md}`` stamped with commit and command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import threading
import time
from typing import Callable

import numpy as np
import torch

from experiments import provenance
from uhead_vllm.capture.placer import ChunkSlots, place_step
from uhead_vllm.capture.destination import RowDestination
from uhead_vllm.generation.host_memory import host_buffer

from .env import REPO_ROOT

OUT = REPO_ROOT / "experiments" / "results" / "bench"
K, CAPACITY, COLUMNS, HIDDEN, STEPS, PERIOD = 256, 190, 3, 576, 16, 0.08


def variants_of(dest: RowDestination) -> dict[str, Callable[[int], None]]:
    """Each variant's work for batch ``i`` (of 8 prepared ones)."""
    prepared = []
    for b in range(8):
        rows = torch.randn(STEPS * K, COLUMNS, HIDDEN).to(torch.bfloat16)
        pos = np.concatenate([np.full(K, 60 + b * STEPS + s) for s in range(STEPS)])
        meta = torch.from_numpy(np.stack([pos, np.arange(STEPS * K) % 1000]).astype(np.int64))
        chunks = ChunkSlots(np.tile(np.arange(K) * CAPACITY, STEPS), np.full(STEPS * K, CAPACITY),
                            np.ones(STEPS * K, dtype=np.int64))
        index = chunks.first + pos
        byte_rows = rows.view(torch.uint8).numpy().reshape(STEPS * K, -1)
        prepared.append((rows, meta, chunks, index, byte_rows))
    whole = torch.from_numpy(dest.byte_rows)
    return {
        "place_step": lambda i: place_step(dest, *prepared[i][:3]),
        "one numpy copy": lambda i: dest.byte_rows.__setitem__(prepared[i][3], prepared[i][4]),
        "torch index_copy_": lambda i: whole.index_copy_(0, torch.from_numpy(prepared[i][3]),
                                                          torch.from_numpy(prepared[i][4])),
        "sleeping": lambda i: time.sleep(0.008),
    }


def engine_loop(seconds: float) -> int:
    """Iterations of a Python-bound loop in ``seconds``."""
    table = {f"req-{i}": i for i in range(K)}
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        total = 0
        for _, v in table.items():
            total += v
        n += 1
    return n


def beside(work: Callable[[int], None], seconds: float) -> tuple[int, float]:
    """The loop's iterations while ``work`` runs every PERIOD in a thread; its mean time a batch."""
    stop, spent = threading.Event(), []

    def placer() -> None:
        i = 0
        while not stop.is_set():
            t = time.perf_counter()
            work(i % 8)
            spent.append(time.perf_counter() - t)
            i += 1
            stop.wait(max(0.0, PERIOD - spent[-1]))

    thread = threading.Thread(target=placer, daemon=True)
    thread.start()
    n = engine_loop(seconds)
    stop.set()
    thread.join()
    return n, statistics.mean(spent)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args(argv)
    dest = RowDestination(host_buffer((K * CAPACITY, COLUMNS, HIDDEN), torch.bfloat16),
                          {t: (t * CAPACITY, CAPACITY) for t in range(K)})
    dest.byte_rows[:] = 0  # every page touched once, as a reused row file's are
    variants = variants_of(dest)
    start = time.perf_counter()
    variants["place_step"](0)
    alone_batch = time.perf_counter() - start
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    batch_ms: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for name, work in variants.items():
            before = engine_loop(args.seconds)
            n, per_batch = beside(work, args.seconds)
            after = engine_loop(args.seconds)
            ratios[name].append(n / ((before + after) / 2))
            batch_ms[name].append(per_batch * 1e3)
    result = {"commit": provenance.commit(),
              "command": "python -m experiments.bench.placer_beside_engine " + shlex.join(sys.argv[1:] if argv is None else argv),
              "batch": {"requests": K, "steps": STEPS, "columns": COLUMNS, "hidden": HIDDEN, "period_s": PERIOD},
              "place_step_alone_ms": alone_batch * 1e3,
              "loop_ratio_median": {k: statistics.median(v) for k, v in ratios.items()}, "loop_ratios": ratios,
              "batch_ms_median": {k: statistics.median(v) for k, v in batch_ms.items()}}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "placer_beside_engine.json").write_text(json.dumps(result, indent=1))
    lines = ["# A Python-bound loop beside a placer thread (CPU)", "",
             f"commit `{result['commit']}`, command `{result['command']}`; {args.rounds} rounds of "
             f"{args.seconds:.0f} s each", "",
             f"`place_step` of one batch alone: {result['place_step_alone_ms']:.1f} ms.", "",
             "| the thread does, every 80 ms | loop throughput (median ratio to alone) | its time per batch, ms |",
             "|---|---:|---:|"]
    lines += [f"| {k} | {result['loop_ratio_median'][k]:.3f} | {result['batch_ms_median'][k]:.1f} |" for k in variants]
    (OUT / "placer_beside_engine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
