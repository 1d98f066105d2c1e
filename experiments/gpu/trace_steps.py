"""The GPU timeline of capture's decode steps next to the same requests untagged, on one engine.

vLLM's own torch profiler (``profiler_config``, ``LLM.start_profile``) records the engine-core
process (CPU ops, CUDA runtime calls, kernels and copies of every stream) during one call of each
way; the traces are summarised here per call: the GPU's busy time (union over streams) and idle
time, per stream, kernels and copies by name, and the host's CUDA runtime calls (launches, graph
replays, synchronisations: a host waiting for the device shows there). ``placed`` against
``untagged`` tells whether capture's cost at small batches is host work or device work.

    python -m experiments.gpu.trace_steps --shape smollm2 --tokenizer .gpu/tok --out DIR [--sequences 16 256]

Writes ``trace-steps.md`` / ``.json`` (commit, command) and keeps the raw traces under ``DIR/traces``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WARM_RUNS = 3  # untimed runs of each way before the traced one: graphs captured, row files registered


def summarise(path: Path) -> dict[str, Any]:
    """One chrome trace: GPU busy / idle (union of kernels, copies and sets over every stream),
    busy per stream, device work by name, and host CUDA runtime calls by name."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in device)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    per_stream: dict[str, float] = defaultdict(float)
    work: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in device:
        per_stream[str(e.get("args", {}).get("stream", e.get("tid")))] += float(e.get("dur", 0))
        w = work[f"{e['cat']}: {e['name'][:90]}"]
        w[0] += 1
        w[1] += float(e.get("dur", 0))
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in runtime:
        c = calls[e["name"]]
        c[0] += 1
        c[1] += float(e.get("dur", 0))
    # vLLM annotates each engine step "execute_context_<requests>(<tokens>)_generation_<requests>(<tokens>)"
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("execute_")),
                   key=lambda e: float(e["ts"]))
    prefill = [{"step": k, "step_name": e["name"], "ms": float(e.get("dur", 0)) / 1e3}
               for k, e in enumerate(steps) if not e["name"].startswith("execute_context_0(")]
    return {"device_span_ms": span / 1e3, "device_busy_ms": busy / 1e3, "device_idle_ms": (span - busy) / 1e3,
            "busy_ms_per_stream": {k: v / 1e3 for k, v in sorted(per_stream.items(), key=lambda kv: -kv[1])},
            "device_work": {k: {"count": int(n), "ms": t / 1e3} for k, (n, t) in sorted(work.items(), key=lambda kv: -kv[1][1])},
            "runtime_calls": {k: {"count": int(n), "ms": t / 1e3} for k, (n, t) in sorted(calls.items(), key=lambda kv: -kv[1][1])},
            "steps": len(steps), "steps_ms": sum(float(e.get("dur", 0)) for e in steps) / 1e3,
            "steps_with_prompt_tokens": prefill}


def report(result: dict[str, Any]) -> str:
    lines = [f"# Decode steps on the GPU timeline, {result['shape']} shape ({result['gpu']}, vLLM {result['vllm']})", "",
             f"commit `{result['commit']}`, command `{result['command']}`; one traced call of each way on one engine "
             f"(engine-core process, vLLM's torch profiler), after {WARM_RUNS} untimed runs of each.", ""]
    for seqs, ways in result["calls"].items():
        lines += [f"## {seqs} sequences", "",
                  "| way | call s (traced) | device span ms | device busy ms | device idle ms | busiest streams (ms) |",
                  "|---|---:|---:|---:|---:|---|"]
        for way, s in ways.items():
            streams = ", ".join(f"{k}: {v:.1f}" for k, v in list(s["busy_ms_per_stream"].items())[:3])
            lines.append(f"| {way} | {s['seconds']:.3f} | {s['device_span_ms']:.1f} | {s['device_busy_ms']:.1f} | "
                         f"{s['device_idle_ms']:.1f} | {streams} |")
        lines += ["", "Engine steps (vLLM's step annotations: requests(tokens) with prompt tokens, then decoding):", "",
                  "| way | steps | their host ms | steps with prompt tokens: name, ms |", "|---|---:|---:|---|"]
        for way, s in ways.items():
            prefill = "; ".join(f"`{p['step_name']}` {p['ms']:.1f}" for p in s["steps_with_prompt_tokens"][:4])
            lines.append(f"| {way} | {s['steps']} | {s['steps_ms']:.1f} | {prefill} |")
        if {"untagged", "placed"} <= ways.keys():
            for key, title in (("device_work", "Device work"), ("runtime_calls", "Host CUDA runtime calls")):
                a, b = ways["untagged"][key], ways["placed"][key]
                grown = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, {}).get("ms", 0) - a.get(k, {}).get("ms", 0)))
                lines += ["", f"{title}, placed against untagged (largest changes):", "",
                          "| name | untagged count | untagged ms | placed count | placed ms |", "|---|---:|---:|---:|---:|"]
                for k in grown[:15]:
                    x, y = a.get(k, {"count": 0, "ms": 0.0}), b.get(k, {"count": 0, "ms": 0.0})
                    lines.append(f"| `{k}` | {x['count']} | {x['ms']:.2f} | {y['count']} | {y['ms']:.2f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["smollm2", "llama8b"], required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sequences", type=int, nargs="+", default=[16, 256])
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    import vllm
    from transformers import AutoTokenizer

    from experiments import provenance
    from experiments.bench.engines import Config, Runner
    from experiments.bench.workload import Workload, rendered_prompts
    from experiments.gpu.bench_gpu import MAX_TOKENS, N, engine_settings, fanout_requests, freeze_startup_heap
    from experiments.gpu.models import SHAPES, build_model

    out = Path(args.out)
    traces = out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    model = str(build_model(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{args.shape}", args.shape,
                            Path(args.tokenizer), save_weights=False))
    n_layers = SHAPES[args.shape]["num_hidden_layers"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = rendered_prompts(tokenizer, max(args.sequences) // N)
    big = Workload(max(args.sequences) // N, N, MAX_TOKENS)
    profiler = {"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False,
                "ignore_frontend": True}
    runner = Runner(Config("ours", "compiled", "bfloat16"), model, "bfloat16", (0, n_layers // 2, n_layers),
                    {**engine_settings(args.shape), "profiler_config": profiler}, prompts, big)
    runner.warmup(big)
    freeze_startup_heap()

    def untagged(wl: Workload) -> None:
        inputs, params = fanout_requests(prompts[: wl.num_prompts], tokenizer)
        if not runner.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        runner.llm.generate(inputs, params, use_tqdm=False)

    ways = {"untagged": untagged, "placed": runner.run}
    calls: dict[str, dict[str, Any]] = {}
    for seqs in args.sequences:
        wl = Workload(seqs // N, N, MAX_TOKENS)
        for _ in range(WARM_RUNS):
            for way in ways.values():
                way(wl)
        for name, way in ways.items():
            before = set(traces.rglob("*.json*"))
            runner.llm.start_profile()
            t0 = time.perf_counter()
            way(wl)
            seconds = time.perf_counter() - t0
            runner.llm.stop_profile()
            for _ in range(600):  # the engine core writes the trace after stop_profile returns
                new = sorted(set(traces.rglob("*.json*")) - before)
                if new:
                    time.sleep(2.0)
                    break
                time.sleep(0.5)
            if not new:
                raise RuntimeError(f"no trace appeared under {traces} for {name} at {seqs} sequences")
            kept = new[0].rename(traces / f"{seqs}-{name}{''.join(new[0].suffixes)}")
            calls.setdefault(str(seqs), {})[name] = {"seconds": seconds, "trace": kept.name, **summarise(kept)}
            print(f"[trace] {seqs} {name}: {seconds:.3f} s, device busy {calls[str(seqs)][name]['device_busy_ms']:.1f} ms",
                  flush=True)
    result = {"shape": args.shape, "gpu": torch.cuda.get_device_name(0), "vllm": vllm.__version__,
              "commit": provenance.commit(), "command": " ".join(["python -m experiments.gpu.trace_steps", *sys.argv[1:]]),
              "calls": calls}
    (out / "trace-steps.json").write_text(json.dumps(result, indent=1))
    (out / "trace-steps.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
