"""What the generator's request form costs a whole call, by process:
``python -m experiments.bench.request_form [--prompts 64] [--n 4] [--tokens 128] [--reps 8]``.

The generator sends one ``n=1`` request of token ids per sample; plain vLLM users send one request
of text per prompt with ``n`` samples. On a GPU the SmolLM2-shaped model's calls are bound by host
work, and the paired bench's split put the generator's form at 0.90-1.07x of plain's on noisy
hosts (docs/gpu.md, session 25): wall time there cannot tell a few percent apart. Here one plain
vLLM engine (tiny Llama, vLLM's engine-core process, CPU) runs the forms alternately, and each
call is measured three ways: wall time, CPU time of this (the frontend) process and CPU time of
the processes vLLM started (engine core, worker). CPU time counts work, not waiting, so it
separates the frontend's share (request processing, output processing, detokenizing) from the
engine's (scheduling, sampling, the forward) and is far less sensitive to a busy neighbour than
wall time. On this CPU the tiny model's forward dominates the engine's share; the frontend's share
is what a GPU host pays on its own cores too.

Writes ``experiments/results/bench/request_form.{json,md}`` stamped with the commit and command.
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

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default form: frontend and engine apart
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads would count as engine work

from .env import REPO_ROOT, setup_env  # noqa: E402
from .processes import EngineProcesses  # noqa: E402
from .workload import counting_prompts, tiny_llama  # noqa: E402
from experiments import provenance  # noqa: E402

OUT = REPO_ROOT / "experiments" / "results" / "bench"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args(argv)
    setup_env()
    from vllm import LLM, SamplingParams

    model = tiny_llama()
    processes = EngineProcesses()
    llm = LLM(model=model, enforce_eager=True, block_size=32, kv_cache_memory_bytes=512 << 20,
              max_model_len=512, max_num_seqs=args.prompts * args.n, max_num_batched_tokens=4096, seed=0)
    if not processes.note("engine"):
        raise RuntimeError("vLLM started no engine-core process")
    tokenizer = llm.get_tokenizer()
    texts = counting_prompts(args.prompts)
    ids = [{"prompt_token_ids": tokenizer(t)["input_ids"]} for t in texts]
    per_sample = [p for p in ids for _ in range(args.n)]

    def params(n: int) -> SamplingParams:
        return SamplingParams(n=n, max_tokens=args.tokens, temperature=1.0, ignore_eos=True)

    forms = {  # each call's own params objects, as each caller builds them
        "text, n per prompt (plain vLLM)": lambda: (texts, params(args.n)),
        "token ids, n per prompt": lambda: (ids, params(args.n)),
        "token ids, one n=1 request per sample (the generator's form)": lambda: (per_sample, params(1)),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in forms}
    for rep in range(args.reps + 1):
        for name, make in forms.items():
            inputs, sp = make()
            llm.reset_prefix_cache()
            gc.collect()
            wall, front, core = time.perf_counter(), time.process_time(), processes.cpu_seconds("engine")
            out = llm.generate(inputs, sp, use_tqdm=False)
            m = {"wall_ms": 1e3 * (time.perf_counter() - wall), "frontend_cpu_ms": 1e3 * (time.process_time() - front),
                 "engine_cpu_ms": 1e3 * (processes.cpu_seconds("engine") - core)}
            tokens = sum(len(c.token_ids) for o in out for c in o.outputs)
            if tokens != args.prompts * args.n * args.tokens:
                raise RuntimeError(f"{name}: {tokens} tokens generated, expected {args.prompts * args.n * args.tokens}")
            if rep:  # the first round warms vLLM's caches
                runs[name].append(m)
        print(f"[request_form] {rep}: " + "; ".join(
            f"{n.split(' (')[0]} {v[-1]['wall_ms']:.0f} ms" for n, v in runs.items() if v), flush=True)
    median = {name: {k: statistics.median(r[k] for r in v) for k in v[0]} for name, v in runs.items()}
    result = {"commit": provenance.commit(),
              "command": "python -m experiments.bench.request_form " + shlex.join(sys.argv[1:] if argv is None else argv),
              "prompts": args.prompts, "n": args.n, "tokens": args.tokens, "runs": runs, "median": median}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "request_form.json").write_text(json.dumps(result, indent=1))
    plain = median[next(iter(forms))]
    lines = [f"# A whole call by request form ({args.prompts} prompts x n={args.n} x {args.tokens} tokens, "
             "tiny Llama, plain vLLM, engine-core process, CPU)", "",
             f"commit `{result['commit']}`, command `{result['command']}`; medians of {args.reps} calls per form, "
             "the forms alternating; in brackets the ratio to plain vLLM's form", "",
             "| request form | wall ms | frontend CPU ms | engine CPU ms (engine core + worker) |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | " + " | ".join(f"{m[k]:.0f} ({m[k] / plain[k]:.3f})"
                                         for k in ("wall_ms", "frontend_cpu_ms", "engine_cpu_ms")) + " |"
              for name, m in median.items()]
    (OUT / "request_form.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
