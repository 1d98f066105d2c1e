"""What a server's held rows cost the engine core's thread: ``python -m experiments.bench.held_takes``.

The GPU serving bench's scored load, without the engine: 64 concurrent requests decoding one row
a step (the head's reduced inputs, 16 float32 values a row), recorded step after step, and takes
of 8 requests' tags at a time (the server coalesces its requests' takes), each with its
safetensors encoding (what the take RPC returns), as the engine thread runs them. The rows held
grow with the steps between takes; the point of the segment store (capture/sinks/held.py) is
that a take's cost does not: so the table is per number of steps held, side by side in one run.
On a CUDA machine the steps' rows come from the device (pinned segments, asynchronous copies).
Writes ``experiments/results/bench/held_takes[-cuda].{json,md}`` stamped with commit, command and
hardware.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from experiments import provenance

from .env import REPO_ROOT

OUT = REPO_ROOT / "experiments" / "results" / "bench"
REQUESTS, WIDTH, PER_TAKE = 64, 16, 8


def one(steps: int, device: str) -> dict:
    """Record ``steps`` decode steps of REQUESTS requests, then take all of them, PER_TAKE tags a take."""
    from uhead_vllm.adapters import ScheduledStep, StepOutputs
    from uhead_vllm.capture.protocol import CaptureSettings, RequestTag, encode_rows
    from uhead_vllm.capture.recorder import RowRecorder

    rec = RowRecorder(CaptureSettings((0,), "float32"), (0,), WIDTH)
    batch = {f"r{i}": 1 for i in range(REQUESTS)}
    tags = {f"r{i}": RequestTag(1000 + i, 0).to_extra_args() for i in range(REQUESTS)}
    qsl = np.arange(REQUESTS + 1)
    ids = torch.arange(REQUESTS, device=device)
    start = time.perf_counter()
    for k in range(steps):
        rec.on_schedule(ScheduledStep(new_requests=list(tags.items()) if k == 0 else [], finished_req_ids=set(),
                                      num_scheduled_tokens=batch))
        rec.on_forward(StepOutputs(req_ids=list(batch), query_start_loc=qsl,
                                   aux=[torch.randn(REQUESTS, WIDTH, device=device)],
                                   positions=torch.full((REQUESTS,), 100 + k, device=device), input_ids=ids))
    record_ms = 1e3 * (time.perf_counter() - start) / steps
    if device == "cuda":
        torch.cuda.synchronize()
    takes, rows = [], 0
    for first in range(0, REQUESTS, PER_TAKE):
        t0 = time.perf_counter()
        got = rec.take_tags(list(range(1000 + first, 1000 + first + PER_TAKE)), forget=True)
        encode_rows(got)
        takes.append(1e3 * (time.perf_counter() - t0))
        rows += got.num_rows
    assert rows == steps * REQUESTS and rec.bytes_held == 0, "a take lost rows"
    return {"steps_held": steps, "record_ms_per_step": round(record_ms, 3),
            "take_ms_median": round(statistics.median(takes), 3), "take_ms_max": round(max(takes), 3),
            "rows_per_take": steps * PER_TAKE}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[32, 130, 520])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    one(8, device)  # warm-up
    cells = []
    for steps in args.steps:
        runs = [one(steps, device) for _ in range(args.reps)]
        cells.append({**runs[0], "take_ms_max": max(r["take_ms_max"] for r in runs),
                      **{k: statistics.median(r[k] for r in runs) for k in ("record_ms_per_step", "take_ms_median")}})
    name = "held_takes" + ("-cuda" if device == "cuda" else "")
    result = {**provenance.stamp("experiments.bench.held_takes", argv, device == "cuda"), "torch": torch.__version__, "workload": f"{REQUESTS} requests decoding, {WIDTH} float32 a row, "
              f"takes of {PER_TAKE} tags", "reps": args.reps, "cells": cells}
    lines = [f"# Held rows: recording and tag takes on the engine thread ({result['workload']}, {device})", "",
             f"commit `{result['commit']}`, command `{result['command']}`, {result['hardware']}, torch "
             f"{result['torch']}; medians of {args.reps} runs", "",
             "| steps held | record ms / step | take ms (median / max) | rows a take |", "|---:|---:|---:|---:|"]
    lines += [f"| {c['steps_held']} | {c['record_ms_per_step']} | {c['take_ms_median']} / {c['take_ms_max']} | "
              f"{c['rows_per_take']} |" for c in cells]
    provenance.write(OUT, name, result, lines)
    return result


if __name__ == "__main__":
    main()
