"""What recording a server's rows costs the engine thread per step: ``python -m experiments.bench.record_churn``.

A server at concurrency 64 rarely repeats a batch: every step one request finishes and another
joins with its prompt's prefill, so the recorder rebuilds its per-batch facts each step. Here the
recorder alone (no engine) is driven as a server drives it: 64 live requests decoding a row a step,
with and without that churn, with rows of two 4,096-wide layers reduced on the device to a head's
16 inputs (``--scores-on-device``) or kept whole; ``on_schedule`` + ``on_forward`` timed per step
side by side in one run, takes (``held_takes.py``) left out. On a CUDA machine the rows come from
the device. Writes ``experiments/results/bench/record_churn[-cuda].{json,md}`` stamped with commit,
command and hardware.
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
REQUESTS, INPUTS, PREFILL = 64, 16, 100


def one(steps: int, churn: bool, reduced: bool, device: str, hidden: int) -> float:
    """Milliseconds per step of the recorder's schedule and forward hooks over ``steps`` steps."""
    from uhead_vllm.adapters import ScheduledStep, StepOutputs
    from uhead_vllm.capture.protocol import CaptureSettings, RequestTag
    from uhead_vllm.capture.recorder import RowRecorder

    weight = torch.randn(INPUTS, 2 * hidden, device=device) if reduced else None
    rec = RowRecorder(CaptureSettings((16, 32), "float32" if reduced else "bfloat16"), (16, 32), hidden,
                      weight=weight)
    live = [f"r{i}" for i in range(REQUESTS)]
    serial = REQUESTS
    aux = [torch.randn(REQUESTS + PREFILL, hidden, device=device, dtype=torch.bfloat16) for _ in range(2)]
    positions = torch.arange(REQUESTS + PREFILL, device=device)
    ids = torch.arange(REQUESTS + PREFILL, device=device, dtype=torch.int32)
    seconds = 0.0
    for k in range(steps + 1):
        new, finished = [], set()
        if k == 0:
            new = [(r, RequestTag(1000 + i, 0).to_extra_args()) for i, r in enumerate(live)]
        elif churn:  # one request leaves, one joins with its prompt
            finished = {live.pop(0)}
            live.append(f"r{serial}")
            new = [(live[-1], RequestTag(1000 + serial, 0).to_extra_args())]
            serial += 1
        tokens = {r: 1 for r in live}
        if k and new:
            tokens[new[0][0]] = PREFILL
        qsl = np.concatenate([[0], np.cumsum([tokens[r] for r in live])]).astype(np.int32)
        n = int(qsl[-1])
        t0 = time.perf_counter()
        rec.on_schedule(ScheduledStep(new_requests=new, finished_req_ids=finished, num_scheduled_tokens=tokens))
        rec.on_forward(StepOutputs(req_ids=list(live), query_start_loc=qsl, aux=[a[:n] for a in aux],
                                   positions=positions[:n], input_ids=ids[:n]))
        if k:  # the first step registers every request
            seconds += time.perf_counter() - t0
        if k % 64 == 0:
            rec.take()  # the rows go, as a server's takes would take them
    return 1e3 * seconds / steps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=4096,
                    help="layer width (on a CPU a small one, e.g. 64, leaves the recorder's own work: the host "
                         "copies and multiplies the rows itself)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [(churn, reduced) for reduced in (True, False) for churn in (False, True)]
    for churn, reduced in cases:  # warm-up
        one(16, churn, reduced, device, args.hidden)
    runs: dict[tuple[bool, bool], list[float]] = {c: [] for c in cases}
    for _ in range(args.reps):  # alternating
        for c in cases:
            runs[c].append(one(args.steps, *c, device, args.hidden))
    cells = [{"churn": churn, "reduced": reduced, "ms_per_step_median": round(statistics.median(runs[(churn, reduced)]), 3),
              "ms_per_step_runs": [round(x, 3) for x in runs[(churn, reduced)]]} for churn, reduced in cases]
    name = "record_churn" + ("-cuda" if device == "cuda" else f"-h{args.hidden}")
    result = {**provenance.stamp("experiments.bench.record_churn", argv, device == "cuda"), "torch": torch.__version__, "workload": f"{REQUESTS} requests decoding, 2 layers x {args.hidden}, "
              f"{PREFILL}-token prefills joining", "steps": args.steps, "reps": args.reps, "cells": cells}
    lines = [f"# The recorder per step, as a server drives it ({result['workload']}, {device})", "",
             f"commit `{result['commit']}`, command `{result['command']}`, {result['hardware']}, torch "
             f"{result['torch']}; medians of {args.reps} alternating runs of {args.steps} steps", "",
             "| rows | batch | ms per step |", "|---|---|---:|"]
    lines += [f"| {'reduced to ' + str(INPUTS) + ' inputs' if c['reduced'] else 'whole (bf16)'} | "
              f"{'one leaves, one joins each step' if c['churn'] else 'the same every step'} | "
              f"{c['ms_per_step_median']} |" for c in cells]
    provenance.write(OUT, name, result, lines)
    return result


if __name__ == "__main__":
    main()
