"""The Python the recorder runs per decode step on its GPU path, measured on CPU:
``python -m experiments.bench.recorder_steps [--requests 16 256] [--steps 400]``.

On a GPU a steady decode step costs the engine's thread the recorder's Python plus one CUDA graph
launch (step_graphs.py). This drives :class:`RowRecorder` through that same path (step batcher,
step graphs, flushes to the placer) with CPU tensors and a stand-in graph whose replay does
nothing, so what is timed is the interpreter's share: per steady step (median) and per step
averaged over flushes. SmolLM2's row width, a destination of one slot per request.

Writes ``experiments/results/bench/recorder_steps.{json,md}`` stamped with the commit and command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import numpy as np
import torch

from experiments import provenance
from uhead_vllm.adapters import ScheduledStep, StepOutputs
from uhead_vllm.capture import step_batch
from uhead_vllm.capture.destination import RowDestination
from uhead_vllm.capture.protocol import CaptureSettings, RequestTag
from uhead_vllm.capture.recorder import RowRecorder
from uhead_vllm.capture.step_graphs import StepGraphs

from .env import REPO_ROOT

OUT = REPO_ROOT / "experiments" / "results" / "bench"
HIDDEN, LAYERS, PROMPT = 576, (0, 15, 30), 40


class _NoGraph:
    def replay(self) -> None:
        pass


class _StandInGraphs(StepGraphs):
    """The step graphs' bookkeeping, with a replay that launches nothing (no CUDA here)."""

    def _graph_of(self, targets, sources):  # noqa: ANN001
        return _NoGraph()


def _allocate(self: step_batch.StepBatcher, device: torch.device) -> None:
    """The GPU layout of the batcher (two buffers, step graphs) in host memory."""
    self.graphs = _StandInGraphs(step_batch._copy_all)
    self._buffers = [step_batch._Buffer(torch.empty((self.capacity, self.columns, self.hidden), dtype=self.dtype),
                                        torch.empty((2, self.capacity), dtype=torch.int64)) for _ in range(2)]


def run(k: int, steps: int) -> dict:
    settings = CaptureSettings(layers=LAYERS, dtype="bfloat16", max_bytes=64 << 30)
    rec = RowRecorder(settings, aux_layers=LAYERS, hidden_size=HIDDEN)
    capacity = PROMPT + steps
    rec.place_into(RowDestination(torch.zeros(k * capacity, len(LAYERS), HIDDEN, dtype=torch.bfloat16),
                                  {t: (t * capacity, capacity) for t in range(k)}))
    req = [f"r{t}" for t in range(k)]
    aux = [torch.randn(max(k, 512), HIDDEN, dtype=torch.bfloat16) for _ in LAYERS]
    ids, pos = torch.zeros(512, dtype=torch.int32), torch.zeros(512, dtype=torch.int64)
    rec.on_schedule(ScheduledStep([(r, RequestTag(t, 0).to_extra_args()) for t, r in enumerate(req)],
                                  {r: 1 for r in req}, set()))
    times = []
    for s in range(steps):
        if s:
            rec.on_schedule(ScheduledStep([], {r: 1 for r in req}, set()))
        out = StepOutputs(list(req), np.arange(k + 1, dtype=np.int32), pos[:k], ids[:k], [a[:k] for a in aux])
        t0 = time.perf_counter()
        rec.on_forward(out)
        times.append(time.perf_counter() - t0)
    graphs = rec._batcher.graphs
    steady = times[steps // 4:]  # after the layouts were captured
    return {"requests": k, "steps": steps, "us_per_step_median": 1e6 * float(np.median(steady)),
            "us_per_step_mean": 1e6 * float(np.mean(steady)), "graphs_captured": graphs.captured,
            "graph_replays": graphs.replays_total}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args(argv)
    original = step_batch.StepBatcher._allocate
    step_batch.StepBatcher._allocate = _allocate
    try:
        results = [run(k, args.steps) for k in args.requests]
    finally:
        step_batch.StepBatcher._allocate = original
    result = {"commit": provenance.commit(),
              "command": "python -m experiments.bench.recorder_steps " + shlex.join(sys.argv[1:] if argv is None else argv),
              "results": results}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "recorder_steps.json").write_text(json.dumps(result, indent=1))
    lines = ["# The recorder's Python per decode step on its GPU path (CPU tensors, stand-in graph replay)", "",
             f"commit `{result['commit']}`, command `{result['command']}`; steps after the first quarter", "",
             "| requests | µs per steady step (median) | µs per step (mean, flushes included) | graphs captured | replays |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['requests']} | {r['us_per_step_median']:.1f} | {r['us_per_step_mean']:.1f} | "
              f"{r['graphs_captured']} | {r['graph_replays']} |" for r in results]
    (OUT / "recorder_steps.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
