"""Where the generator's own host time goes around ``llm.generate``:
``python -m experiments.bench.host_phases [--prompts 64] [--n 4] [--tokens 32] [--reps 6]``.

A tiny random Llama behind vLLM's engine-core process (the default), layers 0/2/4 in bf16: each
repeat resets the caches and times one call, split by wall-clock timers wrapped around the
generator's phases (not cProfile, which inflates many small calls 2-5x). OpenMP threads are made
to sleep when idle (``OMP_WAIT_POLICY=PASSIVE``): vLLM-CPU's spinning threads otherwise slow the
caller's work 10-100x at random after a pass. The model's size does not matter for this host
work, the number of sequences and rows does; on a GPU host the same phases are what is left
after ``generate`` (docs/gpu.md, session 14).

Writes ``experiments/results/bench/host_phases.{json,md}`` stamped with the commit and command.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default form, which this measures
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .env import REPO_ROOT, setup_env  # noqa: E402
from .phases import time_generator_phases, timed  # noqa: E402
from experiments import provenance  # noqa: E402

OUT = REPO_ROOT / "experiments" / "results" / "bench"
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args(argv)
    setup_env()  # its defaults only fill what is unset: the engine process set above stays
    from vllm import SamplingParams

    from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm

    from .workload import counting_prompts, tiny_llama

    model = tiny_llama()
    llm = build_llm(model, (0, 2, 4), capture_dtype="bfloat16", enforce_eager=True, block_size=32,
                    kv_cache_memory_bytes=512 << 20, max_model_len=512, max_num_seqs=args.prompts * args.n,
                    max_num_batched_tokens=4096, seed=0)
    gen = VllmHiddenStatesGenerator(llm)
    times: dict[str, list[float]] = {}
    time_generator_phases(gen, times)
    llm.generate = timed(times, "llm.generate", llm.generate)
    prompts = counting_prompts(args.prompts)
    sp = SamplingParams(n=args.n, max_tokens=args.tokens, temperature=0.8, ignore_eos=True)
    runs = []
    for _ in range(args.reps):
        gen.reset_hs_step_cache(reset_prefix_cache=True)
        gc.collect()
        times.clear()
        start = time.perf_counter()
        res = gen.generate(prompts, sp)
        total = time.perf_counter() - start
        rows = sum(int(s.hidden.shape[0]) for per_prompt in res.hidden_states for s in per_prompt)
        del res
        phases = {k: sum(v) * 1e3 for k, v in times.items()}
        runs.append({"total_ms": total * 1e3, "host_ms": total * 1e3 - phases["llm.generate"], "rows": rows,
                     "phases_ms": phases})
        print(f"[host_phases] total {total * 1e3:.1f} ms, host {runs[-1]['host_ms']:.1f} ms", flush=True)
    steady = runs[1:] if len(runs) > 1 else runs  # the first call makes its row file and warms caches
    median = {k: statistics.median(r["phases_ms"][k] for r in steady) for k in steady[0]["phases_ms"]}
    host = statistics.median(r["host_ms"] for r in steady)
    result = {"commit": provenance.commit(),
              "command": "python -m experiments.bench.host_phases " + shlex.join(sys.argv[1:] if argv is None else argv),
              "sequences": args.prompts * args.n, "tokens": args.tokens, "rows": steady[0]["rows"], "runs": runs,
              "median_host_ms": host, "median_phases_ms": median}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "host_phases.json").write_text(json.dumps(result, indent=1))
    lines = [f"# The generator's host time around `llm.generate` ({result['sequences']} sequences x "
             f"{args.tokens} tokens, {result['rows']} rows, tiny Llama, engine-core process, CPU)", "",
             f"commit `{result['commit']}`, command `{result['command']}`; medians of {len(steady)} calls "
             "after the first", "",
             f"Host time (the call's wall time less `llm.generate`): **{host:.1f} ms**.", "",
             "| phase | ms |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in sorted(median.items(), key=lambda kv: -kv[1])]
    (OUT / "host_phases.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
