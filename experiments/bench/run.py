"""One command for the capture benchmark: ``python -m experiments.bench.run [--quick]``.

Phases, all in this process unless noted:
1. build every engine configuration (stock vLLM, ours fp32/bf16 storage, the common approach), in
   compiled and eager mode, all alive at once, and warm each up on the workload's batch shape;
2. time ``reps`` passes of the same workload per configuration, round-robin, reversing the order on
   every other repeat, so machine drift hits all configurations alike;
3. the multi-step online best-of-n count on our eager engine while (full profile) child processes
   measure peak RSS per configuration; neither phase reports a time that the other disturbs;
4. write ``<out>/<profile>.json`` and ``<out>/<profile>.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from experiments import provenance

from .env import REPO_ROOT, setup_env

DEFAULT_OUT = REPO_ROOT / "experiments" / "results" / "bench"


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _profile(args: argparse.Namespace):
    from .profiles import FULL, QUICK

    p = QUICK if args.quick else FULL
    changes = {}
    if args.reps is not None:
        changes["reps"] = args.reps
    if args.no_memory:
        changes["memory_subprocess"] = False
    if args.modes:
        changes["modes"] = tuple(args.modes.split(","))
    if args.workload:
        from .workload import Workload

        a, b, c = (int(x) for x in args.workload.split("x"))
        changes["workload"] = Workload(num_prompts=a, n=b, max_tokens=c)
    if args.multistep:
        from .workload import MultiStepWorkload

        q, c, s, t = (int(x) for x in args.multistep.split("x"))
        changes["multistep"] = MultiStepWorkload(num_questions=q, candidates=c, steps=s, max_step_tokens=t)
    return dataclasses.replace(p, **changes) if changes else p


def _measure_memory(profile, model: str, out_dir: Path, with_common: bool) -> list[dict]:
    """Peak RSS of each configuration, one fresh child process at a time.

    One at a time and after everything else: on a 2-core machine, children side by side (or next
    to the multi-step phase) oversubscribe the CPU so badly that the phase took minutes instead
    of seconds; RSS itself does not depend on CPU share.
    """
    from .memory import measure
    from .profiles import memory_configs

    results = []
    for cfg in memory_configs(with_common):
        spec = {"config": dataclasses.asdict(cfg), "model": model, "model_dtype": profile.model_dtype,
                "layers": list(profile.layers), "engine": profile.engine,
                "workload": profile.workload.to_dict()}
        try:
            results.append(measure(spec, out_dir / f"rss-{cfg.name}.json", timeout=1200))
        except Exception as exc:  # a failed child is reported as such, never as a number
            results.append({"config": cfg.name, "error": repr(exc)})
        _log(f"peak RSS measured: {cfg.name}")
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.run", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model, tiny workload, eager only")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    ap.add_argument("--reps", type=int, default=None, help="timed repeats per configuration")
    ap.add_argument("--modes", default=None, help="comma list of compiled,eager")
    ap.add_argument("--workload", default=None, help="PROMPTSxNxTOKENS, e.g. 32x4x64")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-RSS child processes")
    ap.add_argument("--memory-common", action="store_true", help="also measure the common approach's RSS")
    ap.add_argument("--multistep", default=None, help="QUESTIONSxCANDIDATESxSTEPSxTOKENS, e.g. 8x4x4x48")
    args = ap.parse_args(argv)
    setup_env()
    t_start = time.perf_counter()
    load_start = os.getloadavg()

    import torch
    import vllm
    from transformers import AutoTokenizer

    from uhead_vllm.models import model_identity

    from .engines import Runner
    from .multistep import run_multistep
    from .profiles import configs, model_path
    from .report import (bytes_per_token, check_targets, markdown, performance_section,
                         summarize_throughput)
    from .workload import rendered_prompts

    profile = _profile(args)
    model = str(model_path(profile))
    identity = model_identity(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = rendered_prompts(tokenizer, profile.workload.num_prompts)
    wl = profile.workload

    runners: dict[str, Runner] = {}
    setup: dict[str, dict] = {}
    cfgs = configs(profile)
    for cfg in cfgs:
        _log(f"building {cfg.name}")
        runner = Runner(cfg, model, profile.model_dtype, profile.layers, profile.engine, prompts, wl)
        t0 = time.perf_counter()
        runner.warmup(wl)
        setup[cfg.name] = {"load_seconds": runner.load_seconds, "warmup_seconds": time.perf_counter() - t0}
        runners[cfg.name] = runner

    runs: dict[str, list[dict]] = {c.name: [] for c in cfgs}
    for rep in range(profile.reps):
        order = cfgs if rep % 2 == 0 else list(reversed(cfgs))
        for cfg in order:
            res = runners[cfg.name].run()
            row = {"rep": rep, "seconds": res.seconds, "generated_tokens": res.generated_tokens,
                   "tok_per_s": res.tok_per_s, "cpu_seconds": res.cpu_seconds,
                   "tok_per_cpu_s": res.tok_per_cpu_s, "rows": res.rows, "rows_forwarded": res.rows_forwarded,
                   "payload_bytes": res.payload_bytes, "hidden_bytes": res.hidden_bytes, **res.extra}
            runs[cfg.name].append(row)
            _log(f"rep {rep} {cfg.name}: {res.tok_per_s:.1f} tok/s ({res.seconds:.2f} s)")
    load_timing_end = os.getloadavg()

    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    _log("multi-step online best-of-n")
    ms_runner = runners.get("ours-eager-float32") or next(r for n, r in runners.items() if n.startswith("ours-"))
    multistep = run_multistep(ms_runner.gen, profile.multistep)
    rss: list[dict] = []
    if profile.memory_subprocess:
        # The in-process engines stay alive (shutting one down tears down the process-wide
        # parallel state the others use) but idle; each child has its own process.
        rss = _measure_memory(profile, model, Path(tempfile.mkdtemp(prefix="uhead-bench-rss-")), args.memory_common)
    for r in list(runners.values()):
        r.close()

    throughput = summarize_throughput(runs, profile.modes)
    for name, s in setup.items():
        throughput["configs"][name].update(s)
    num_layers = len(profile.layers)
    memory = {
        "bytes_per_token": bytes_per_token(runs, num_layers, identity["hidden_size"]),
        "method": (
            "one fresh child process per configuration, one at a time after the timed and multi-step "
            "phases (eager, same workload): RSS sampled every 5 ms "
            "during one pass with the results kept alive; run delta = sampled peak - RSS after "
            "engine build and warm-up; VmHWM = lifetime peak of the child"
            if profile.memory_subprocess else "not measured (quick profile or --no-memory)"),
        "peak_rss": sorted(rss, key=lambda e: str(e.get("config"))) if rss else None,
    }
    command = "python -m experiments.bench.run" + (" " + shlex.join(argv if argv is not None else sys.argv[1:])
                                                    if (argv if argv is not None else sys.argv[1:]) else "")
    result = {
        "meta": {
            "command": command.strip(),
            "profile": profile.to_dict(),
            "model": {**identity, "path": model},
            "git_commit": provenance.commit(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_after_timing": load_timing_end,
            "loadavg_end": os.getloadavg(),
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
            "duration_seconds": time.perf_counter() - t_start,
            "engine_core": "in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
        },
        "throughput": throughput,
        "memory": memory,
        "multistep": multistep,
        "notes": [
            "Throughput = generated tokens / wall time of the whole call, including our engine-side "
            "assembly (exact rows, prefix-cache fill from the row store) or the common approach's "
            "fetch + unpickle. The prefix cache (and our row store) is reset before every pass.",
            "The common approach runs in eager mode (its forward hooks never fire in compiled graphs), "
            "in the same process, so its pickled payload crosses no process boundary here; the "
            "pickle/unpickle cost is still paid. It sums hidden + residual like ours (the widely used "
            "extension keeps only the first element, the MLP delta, which is wrong). It returns only "
            "the rows the engine forwarded: prefix-cached rows are missing, where ours fills them.",
            "Engines are all alive at once in one process; repeats run round-robin with the order "
            "reversed on every other repeat; ratios are medians of per-repeat pairs.",
            "Other work on this 2-core machine adds noise: see the load averages above.",
        ],
    }
    result["targets"] = check_targets(throughput, multistep)
    result["meta"]["duration_seconds"] = time.perf_counter() - t_start
    (out_dir / f"{profile.name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / f"{profile.name}.md").write_text(markdown(result))
    (out_dir / f"{profile.name}_performance.md").write_text(performance_section(result))
    _log(f"wrote {out_dir / (profile.name + '.json')} and .md in {result['meta']['duration_seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
