"""The recorder's host cost per step on a real GPU, without vLLM: where the engine thread's time goes.

The capturing engine's own thread pays for recording every step (``record_seconds``: 0.58 ms per
step at 16 sequences and 0.9 ms at 256, Llama-8B shape, an H100 run). At small batches vLLM's step
is short, so that time shows directly in throughput. This drives :class:`RowRecorder` with
synthetic steps shaped like the benchmark's (``K`` requests: one prefill of ``--prompt`` tokens,
then one-token decode steps; three bf16 aux outputs of ``--hidden`` columns on the device, padded
like CUDA-graph outputs), with a row destination and its placer thread as in a real generation,
and a device sleep per step standing in for the forward (the host waits for the step before
each, as vLLM's asynchronous scheduling waits for the sampled tokens). It reports the mean host time of
``on_forward`` per decode step (timed without a profiler) and a cProfile of those calls in a
second run (what each torch / numpy call costs).

    python -m experiments.gpu.bench_recorder --out DIR [--requests 16 256] [--steps 128]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

from experiments import provenance
from uhead_vllm.adapters import ScheduledStep, StepOutputs
from uhead_vllm.capture.destination import RowDestination
from uhead_vllm.capture.protocol import CaptureSettings, RequestTag
from uhead_vllm.capture.recorder import RowRecorder
from uhead_vllm.generation.host_memory import host_buffer

LAYERS = (0, 16, 32)
SAMPLES = 4  # sequences per prompt (sibling groups), as in the benchmark


def run(k: int, steps: int, prompt: int, hidden: int, forward_ms: float, profile: bool) -> dict:
    """One synthetic generation of ``k`` requests; returns per-step host times (and a profile)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run only
    settings = CaptureSettings(layers=LAYERS, dtype="bfloat16", max_bytes=64 << 30)
    rec = RowRecorder(settings, aux_layers=LAYERS, hidden_size=hidden)
    capacity = prompt + steps
    slots = {t: (t * capacity, capacity) for t in range(k)}
    groups = [(prompt, tuple(range(g, min(g + SAMPLES, k)))) for g in range(0, k, SAMPLES)]
    dest = RowDestination(host_buffer((k * capacity, len(LAYERS), hidden), torch.bfloat16), slots,
                          [g for g in groups if len(g[1]) > 1])
    rec.place_into(dest)
    req_ids = [f"r{t}" for t in range(k)]
    padded = max(k * prompt, 512)
    aux = [torch.randn(padded, hidden, device=device, dtype=torch.bfloat16) for _ in LAYERS]
    input_ids = torch.randint(0, 1000, (padded,), device=device, dtype=torch.int32)
    positions = torch.zeros(padded, device=device, dtype=torch.int64)
    cycles = int(forward_ms * 1.4e6)  # ~1.4 GHz clock: torch.cuda._sleep counts cycles
    times, schedule_times, prof, forward_done = [], [], cProfile.Profile() if profile else None, []
    for step in range(steps + 1):
        new = [(r, RequestTag(t, t % SAMPLES).to_extra_args()) for t, r in enumerate(req_ids)] if step == 0 else []
        n = prompt if step == 0 else 1
        scheduled = ScheduledStep(new, {r: n for r in req_ids}, set())
        t0 = time.perf_counter()
        rec.on_schedule(scheduled)
        if step:
            schedule_times.append(time.perf_counter() - t0)
        start = 0 if step == 0 else prompt + step - 1
        positions[: k * n] = torch.arange(start, start + n, device=device).repeat(k)  # in place, as vLLM's buffers
        if device.type == "cuda":
            torch.cuda._sleep(cycles)  # the forward the copies queue behind
            forward_done.append(torch.cuda.Event())
            forward_done[-1].record()
        out = StepOutputs(req_ids, np.arange(k + 1, dtype=np.int32) * n, positions, input_ids, aux)
        t0 = time.perf_counter()
        if prof is not None and step:
            prof.enable()
        rec.on_forward(out)
        if prof is not None and step:
            prof.disable()
        if step:
            times.append(time.perf_counter() - t0)
        if len(forward_done) > 1:  # vLLM (async scheduling) waits for the step before's sampled tokens
            forward_done[-2].synchronize()
    graphs = rec._batcher.graphs if rec._batcher is not None else None
    t0 = time.perf_counter()
    rows = rec.take()
    drain = time.perf_counter() - t0
    result = {"requests": k, "steps": steps, "rows": rows.num_rows, "error": rows.error,
              "record_ms_per_decode_step": 1e3 * float(np.mean(times)),
              "record_ms_p90": 1e3 * float(np.percentile(times, 90)),
              "schedule_ms_per_decode_step": 1e3 * float(np.mean(schedule_times)),
              "place_seconds": rows.stats["place_seconds"], "drain_seconds_after_last_step": drain,
              "step_graphs": None if graphs is None else {"captured": graphs.captured,
                                                          "replayed": rows.stats["forwards_replayed"]}}
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        result["profile"] = text.getvalue()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--forward-ms", type=float, default=6.0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run(16, 8, args.prompt, args.hidden, args.forward_ms, False)  # warm-up: CUDA context, pinned pool
    results = []
    for k in args.requests:  # timed without the profiler (it slows every Python call), then profiled
        timed = run(k, args.steps, args.prompt, args.hidden, args.forward_ms, False)
        profiled = run(k, args.steps, args.prompt, args.hidden, args.forward_ms, True)
        results.append({**timed, "profile": profiled["profile"],
                        "record_ms_per_decode_step_profiled": profiled["record_ms_per_decode_step"]})
    commit = provenance.commit()
    meta = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none", "torch": torch.__version__, "commit": commit,
            "command": " ".join(["python -m experiments.gpu.bench_recorder", *sys.argv[1:]])}
    (out / "bench-recorder.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    for r in results:
        print(f"[recorder] {r['requests']} requests: {r['record_ms_per_decode_step']:.3f} ms/step "
              f"(p90 {r['record_ms_p90']:.3f}; on_schedule {r['schedule_ms_per_decode_step']:.3f}), place {r['place_seconds']:.3f} s, rows {r['rows']}, "
              f"error {r['error']}, step graphs {r['step_graphs']}", flush=True)
    print(results[-1]["profile"][:6000])


if __name__ == "__main__":
    main()
