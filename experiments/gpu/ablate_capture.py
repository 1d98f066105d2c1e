"""Where capture's cost inside vLLM's ``generate`` comes from, on one capturing engine.

Three ways of running the same batch alternate on one engine (CUDA graphs, Model Runner V2,
vLLM's default engine-core process), so process-to-process noise cancels:

- ``untagged``: the generator's request form (token ids, one n=1 request per sample) without
  capture tags: the recorder sees the requests but records nothing;
- ``kept``: capture, rows kept in the worker's pinned memory and fetched after the pass (no row
  destination, so no placer thread beside the engine);
- ``placed``: capture as shipped, rows written into the caller's shared buffer while vLLM runs by
  the placer thread beside the engine;
- ``written``: the same, the rows written into that buffer by the GPU (``capture/file_writer.py``;
  asked per call, with the destination);
- ``settled``: ``placed`` with the requests sent only once the worker answered ``place_into``
  (``UHEAD_SETTLE_PLACEMENT``), so the engine core starts idle, as for plain vLLM.

``kept`` - ``untagged`` prices the engine thread's recording; ``placed`` - ``kept`` the placer
thread (and the shared-memory destination) during the pass. ``--timing`` builds the engine with
``experiments/gpu/step_timing.py``'s extension and splits every way's steps into launch, record
and the rest of the step (sampling, scheduler, outputs), summed per run, and times the engine
process's garbage collections. ``--spy PY_SPY`` records the engine-core process with py-spy during
every run and tables, per batch size, which frames of its main thread grow from ``untagged`` to
``placed``, inclusive and self (``spy_stacks.py``; raw stacks kept in ``spy.tgz``).

    VLLM_ENABLE_V1_MULTIPROCESSING=1 python -m experiments.gpu.ablate_capture --shape smollm2 \\
        --tokenizer .gpu/tok --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments import provenance
from uhead_vllm.envs import FILE_WRITES_ENV
from uhead_vllm.envs import SETTLE_PLACEMENT_ENV

REPO = Path(__file__).resolve().parents[2]
SEQUENCES = (16, 256)  # prompts x N samples
REPS = 7
STEP_PARTS = ("steps", "launch_ms", "record_ms", "rest_ms", "flushes", "rest_after_flush_mean_ms",
              "rest_after_other_mean_ms")
#: Per run, the engine-core process's garbage collections (any thread) by generation, and their time.
GC_PARTS = ("gc0", "gc1", "gc2", "gc_ms")
#: py-spy's samples per second (``--spy``).
SPY_RATE = 1000
#: Per run, the engine-core process's main thread (the engine loop) and its other threads together
#: (the placer, vLLM's socket threads, ...): CPU time, time runnable but waiting for a core, minor
#: page faults, context switches (voluntary: it blocked, e.g. on the GIL or a lock).
THREAD_PARTS = ("main_cpu_ms", "main_runq_ms", "main_minflt", "main_vol_switches", "main_invol_switches",
                "others_cpu_ms", "others_runq_ms", "others_minflt", "busiest_other")


def engine_threads() -> dict[tuple[int, int], dict[str, Any]]:
    """Per thread of this process's child processes (vLLM's engine core): scheduler counters
    from /proc (``schedstat``: ns on a core and ns runnable waiting; ``stat``: minor faults;
    ``status``: context switches)."""
    import psutil

    out = {}
    for child in psutil.Process().children(recursive=True):
        for task in Path(f"/proc/{child.pid}/task").glob("*"):
            try:
                run_ns, wait_ns, _ = (int(x) for x in (task / "schedstat").read_text().split())
                stat = (task / "stat").read_text()
                comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
                status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
            except (OSError, ValueError):
                continue  # the thread ended
            out[(child.pid, int(task.name))] = {
                "comm": comm, "cpu_ns": run_ns, "runq_ns": wait_ns, "minflt": int(fields[7]),
                "vol": int(status.get("voluntary_ctxt_switches", 0)), "invol": int(status.get("nonvoluntary_ctxt_switches", 0))}
    return out


def thread_deltas(before: dict, after: dict) -> dict[str, Any]:
    """What each thread did between two :func:`engine_threads` snapshots, as ``THREAD_PARTS``; the
    main thread is the engine-core process's first (its tid is its pid)."""
    diff = {k: {f: v[f] - before.get(k, {}).get(f, 0) for f in ("cpu_ns", "runq_ns", "minflt", "vol", "invol")}
            | {"comm": v["comm"], "tid": k[1]} for k, v in after.items()}
    main = [d for (pid, tid), d in diff.items() if pid == tid]
    main = max(main, key=lambda d: d["cpu_ns"]) if main else None
    others = [d for d in diff.values() if d is not main]
    busiest = max(others, key=lambda d: d["cpu_ns"], default=None)
    if main is None:
        return {k: None for k in THREAD_PARTS}
    return {"main_cpu_ms": main["cpu_ns"] / 1e6, "main_runq_ms": main["runq_ns"] / 1e6, "main_minflt": main["minflt"],
            "main_vol_switches": main["vol"], "main_invol_switches": main["invol"],
            "others_cpu_ms": sum(d["cpu_ns"] for d in others) / 1e6, "others_runq_ms": sum(d["runq_ns"] for d in others) / 1e6,
            "others_minflt": sum(d["minflt"] for d in others),
            "busiest_other": None if busiest is None else f"{busiest['comm']} {busiest['cpu_ns'] / 1e6:.1f} ms"}


def step_phases(taken: dict[str, Any]) -> dict[str, Any]:
    """One run's engine steps (``step_timing.py``: entered, launched, recorded, flushed) summed by
    part in ms (a step's ``rest`` runs to the next step's entry, so the last step has none), and
    its garbage collections."""
    steps, collections = taken["steps"], taken["gc"]
    gc_parts = {"gc0": collections["collections"][0], "gc1": collections["collections"][1],
                "gc2": collections["collections"][2], "gc_ms": 1e3 * sum(collections["seconds"])}
    launch = [1e3 * (b - a) for a, b, _, _ in steps]
    record = [1e3 * (c - b) for _, b, c, _ in steps]
    rest = [1e3 * (nxt[0] - c) for (_, _, c, _), nxt in zip(steps, steps[1:])]
    after_flush = [r for r, (*_, flushed) in zip(rest, steps) if flushed]
    after_other = [r for r, (*_, flushed) in zip(rest, steps) if not flushed]
    return {"steps": len(steps), "launch_ms": sum(launch), "record_ms": sum(record), "rest_ms": sum(rest),
            "flushes": len(after_flush),
            "rest_after_flush_mean_ms": sum(after_flush) / len(after_flush) if after_flush else None,
            "rest_after_other_mean_ms": sum(after_other) / len(after_other) if after_other else None,
            **gc_parts}


def engine_pid() -> int:
    """The engine-core process among this process's children (vLLM names it ``VLLM::EngineCore``)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    named = [c for c in children if "EngineCor" in c.name()]
    if not named:
        raise RuntimeError(f"no engine-core process among {[c.name() for c in children]}")
    return named[0].pid


class Spy:
    """py-spy recording the engine-core process for the length of one run."""

    def __init__(self, binary: str, pid: int, path: Path):
        self.proc = subprocess.Popen([binary, "record", "--pid", str(pid), "--rate", str(SPY_RATE), "--format", "raw",
                                      "--threads", "--nonblocking", "-o", str(path)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # attached and sampling before the run starts

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=60)
        if self.proc.returncode != 0:
            raise RuntimeError(f"py-spy failed ({self.proc.returncode}): {err.strip()[-500:]}")


#: The engine loop's frame: inclusive times count from it down (the engine core is forked, so its
#: stacks begin with the frames of the process that built the engine).
SPY_BELOW = "EngineCoreProc.run_busy_loop"


def spy_section(files: dict[tuple[int, str], list[Path]], pid: int) -> list[str]:
    """Per batch size, the engine main thread's sampled time per run and the frames that grow
    most from ``untagged`` to ``placed``: with the frame on the stack, and on top (self time)."""
    from experiments.gpu.spy_stacks import growth_table, per_run_ms

    lines = ["", f"py-spy, the engine-core main thread (sampled at {SPY_RATE}/s while on a core; ms per run, "
             "means over runs; inclusive from the engine loop down, and self time):"]
    for seqs in sorted({s for s, _ in files}):
        ways = {name: per_run_ms(paths, pid, SPY_RATE, SPY_BELOW) for (s, name), paths in files.items() if s == seqs}
        lines += ["", f"{seqs} sequences; sampled ms per run: "
                  + ", ".join(f"{name} {total:.0f}" for name, (_, _, total) in ways.items())]
        for way in ("placed", "written", "settled"):
            if "untagged" not in ways or way not in ways:
                continue
            for kind, index in (("inclusive", 0), ("self", 1)):
                lines += ["", f"{kind}, untagged to {way}:", "", *growth_table(ways["untagged"][index], ways[way][index],
                                                                               "untagged", way, top=20)]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["smollm2", "llama8b"], required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timing", action="store_true", help="time each engine step's parts (step_timing.py)")
    ap.add_argument("--spy", metavar="PY_SPY", help="py-spy's binary: record the engine core during every run")
    ap.add_argument("--reps", type=int, default=REPS, help=f"runs of each way per batch size (default {REPS})")
    ap.add_argument("--ways", default="untagged,placed,written",
                    help="comma-separated, of untagged, kept, placed, written, settled (default: untagged, "
                         "placed, written; kept takes seconds per run)")
    ap.add_argument("--pin", action="store_true",
                    help="this process and the engine-core process on 4 cores of their own each (bench_gpu.CorePinner)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    import vllm
    from transformers import AutoTokenizer

    import uhead_vllm.generation.first_pass as generator_module
    from experiments.bench.engines import Config, Runner
    from experiments.bench.workload import Workload, rendered_prompts
    from experiments.bench.processes import EngineProcesses
    from experiments.gpu.bench_gpu import (MAX_TOKENS, N, CorePinner, engine_settings, fanout_requests,
                                           freeze_startup_heap, with_env)
    from experiments.gpu.models import SHAPES, build_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(build_model(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{args.shape}", args.shape,
                            Path(args.tokenizer), save_weights=False))
    n_layers = SHAPES[args.shape]["num_hidden_layers"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = rendered_prompts(tokenizer, max(SEQUENCES) // N)
    big = Workload(max(SEQUENCES) // N, N, MAX_TOKENS)
    if args.timing:  # the engine loads this extension in place of the capture extension (named, not
        # imported: importing it here would patch this process's view of the capture adapters)
        import uhead_vllm.generation.backends.aux as aux_backend

        aux_backend.EXTENSION_QUALNAME = "experiments.gpu.step_timing.StepTimingExtension"
    pinner = CorePinner(3) if args.pin else None  # 4 shares of a 16-core host, as bench_gpu --paired --pin
    processes = EngineProcesses()
    runner = Runner(Config("ours", "compiled", "bfloat16"), model, "bfloat16", (0, n_layers // 2, n_layers),
                    engine_settings(args.shape), prompts, big)
    pids = processes.note("capture")
    if pinner is not None:
        pinner.pin_engine("capture", pids)
    runner.warmup(big)
    freeze_startup_heap()
    physical_memory = generator_module._physical_memory

    def untagged(wl: Workload) -> dict[str, Any]:
        inputs, params = fanout_requests(prompts[: wl.num_prompts], tokenizer)
        if not runner.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        t0 = time.perf_counter()
        runner.llm.generate(inputs, params, use_tqdm=False)
        return {"seconds": time.perf_counter() - t0}

    def captured(wl: Workload, placed: bool, device_writes: bool = False, settled: bool = False) -> dict[str, Any]:
        # No room for a destination buffer: the generator lets the worker keep the rows instead.
        generator_module._physical_memory = physical_memory if placed else (lambda: 0)
        # Both are read in this process at every call: sent with the destination / when it is sent.
        asked = {FILE_WRITES_ENV: "1" if device_writes else "0", SETTLE_PLACEMENT_ENV: "1" if settled else "0"}
        try:
            r = with_env(asked, runner.run)(wl)
        finally:
            generator_module._physical_memory = physical_memory
        return {"seconds": r.seconds, **r.extra}

    def timed(way: Any) -> Any:
        def run(wl: Workload) -> dict[str, Any]:
            runner.llm.collective_rpc("timing_take")  # steps of anything before
            before = engine_threads()
            r = way(wl)
            threads = thread_deltas(before, engine_threads())
            return {**r, **step_phases(json.loads(runner.llm.collective_rpc("timing_take")[0])), **threads}
        return run

    spy_dir = out / "spy"
    spy_files: dict[tuple[int, str], list[Path]] = {}

    def spied(name: str, way: Any) -> Any:
        def run(wl: Workload) -> dict[str, Any]:
            files = spy_files.setdefault((wl.num_prompts * wl.n, name), [])
            path = spy_dir / f"{wl.num_prompts * wl.n}-{name}-{len(files)}.txt"
            spy = Spy(args.spy, engine_pid(), path)
            try:
                return way(wl)
            finally:
                spy.stop()
                files.append(path)
        return run

    ways = {"untagged": untagged, "kept": lambda wl: captured(wl, False), "placed": lambda wl: captured(wl, True),
            "written": lambda wl: captured(wl, True, device_writes=True),
            "settled": lambda wl: captured(wl, True, settled=True)}
    unknown = set(args.ways.split(",")) - set(ways)
    if unknown:
        raise SystemExit(f"--ways: unknown {sorted(unknown)} (of {', '.join(ways)})")
    ways = {name: way for name, way in ways.items() if name in args.ways.split(",")}
    if args.timing:
        ways = {name: timed(way) for name, way in ways.items()}
    if args.spy:
        spy_dir.mkdir(exist_ok=True)
        ways = {name: spied(name, way) for name, way in ways.items()}
    result: dict[str, Any] = {}
    for seqs in SEQUENCES:
        wl = Workload(seqs // N, N, MAX_TOKENS)
        runs: dict[str, list[dict]] = {name: [] for name in ways}
        for _ in range(args.reps):
            for name, way in ways.items():
                runs[name].append(way(wl))
        result[str(seqs)] = {
            name: {"median_seconds": float(np.median([r["seconds"] for r in rs])),
                   "median_generate_seconds": float(np.median([r.get("vllm_generate_seconds", r["seconds"]) for r in rs])),
                   "median_record_seconds": float(np.median([r.get("record_seconds", 0.0) for r in rs])),
                   "median_place_seconds": float(np.median([r.get("place_seconds", 0.0) for r in rs])),
                   **({f"median_{k}": float(np.median([r[k] for r in rs if r[k] is not None] or [np.nan]))
                       for k in STEP_PARTS + GC_PARTS + THREAD_PARTS[:-1]} if args.timing else {}),
                   "runs": rs}
            for name, rs in runs.items()}
    spied_pid = engine_pid() if args.spy else None
    runner.close()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    meta = {"gpu": gpu, "vllm": vllm.__version__, "commit": provenance.commit(),
            "command": " ".join(["python -m experiments.gpu.ablate_capture", *sys.argv[1:]]),
            "engine_process": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"), "reps": args.reps,
            "pinned_cores": None if pinner is None else pinner.assigned, "engine_pid": spied_pid}
    (out / f"ablate-{args.shape}.json").write_text(json.dumps({"meta": meta, "results": result}, indent=1))
    lines = [f"# Capture's cost inside generate, {args.shape} shape ({meta['gpu']}, vLLM {meta['vllm']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`; medians of {args.reps} alternating runs on one engine.", "",
             "| sequences | way | total s | inside generate s | (min-max) | engine-thread record s | placer s |",
             "|---|---|---|---|---|---|---|"]
    for seqs, ways_result in result.items():
        for name, r in ways_result.items():  # the spread: a host with noisy neighbours shows here first
            inside = [x.get("vllm_generate_seconds", x["seconds"]) for x in r["runs"]]
            lines.append(f"| {seqs} | {name} | {r['median_seconds']:.3f} | {r['median_generate_seconds']:.3f} | "
                         f"{min(inside):.3f}-{max(inside):.3f} | {r['median_record_seconds']:.3f} | "
                         f"{r['median_place_seconds']:.3f} |")
    if args.timing:
        lines += ["", "Engine steps (sums per run, ms; medians over runs; `rest`: from recording done to the "
                  "next step, the engine's own work; means per step after a flush and after other steps):", "",
                  "| sequences | way | " + " | ".join(STEP_PARTS + GC_PARTS) + " |",
                  "|---|---|" + "---|" * len(STEP_PARTS + GC_PARTS)]
        for seqs, ways_result in result.items():
            for name, r in ways_result.items():
                lines.append(f"| {seqs} | {name} | "
                             + " | ".join(f"{r[f'median_{k}']:.3f}" for k in STEP_PARTS + GC_PARTS) + " |")
        lines += ["", "Engine-core threads per run (medians; `runq`: runnable but waiting for a core; the busiest "
                  "other thread of the last run):", "",
                  "| sequences | way | " + " | ".join(THREAD_PARTS) + " |", "|---|---|" + "---|" * len(THREAD_PARTS)]
        for seqs, ways_result in result.items():
            for name, r in ways_result.items():
                lines.append(f"| {seqs} | {name} | " + " | ".join(f"{r[f'median_{k}']:.1f}" for k in THREAD_PARTS[:-1])
                             + f" | {r['runs'][-1].get('busiest_other')} |")
    if args.spy:
        lines += spy_section(spy_files, meta["engine_pid"])
        with tarfile.open(out / "spy.tgz", "w:gz") as tgz:
            tgz.add(spy_dir, arcname="spy")
    (out / f"ablate-{args.shape}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
