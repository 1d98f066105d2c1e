"""How long vLLM's ``LLM.generate`` takes to accept a call's requests, by request form:
``python -m experiments.bench.request_adding [--prompts 64] [--n 4] [--reps 6]``.

Plain vLLM sends one request per prompt with ``n`` samples (vLLM makes the children from one
processed request); the generator sends one ``n=1`` request per sample, each with its own capture
tag, so vLLM processes ``n`` times as many. Processing starts with a deep copy of the request's
``SamplingParams`` unless ``skip_clone`` says the object is the request's own, which the
generator's per-sample copies are. With vLLM's engine core in this process (no engine running
while requests are added) this sums the time of every ``add_request`` for: plain ``n``, the
generator's form with vLLM's deep copies, and the same with ``skip_clone`` (what the generator
sends). On a GPU host the adding overlaps the engine's first steps: requests accepted later are
prefilled in later steps (``experiments/gpu/trace_steps.py``).

Writes ``experiments/results/bench/request_adding.{json,md}`` stamped with the commit and command.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import statistics
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # requests are all added before any step runs

from .env import REPO_ROOT, setup_env  # noqa: E402
from experiments import provenance  # noqa: E402

OUT = REPO_ROOT / "experiments" / "results" / "bench"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args(argv)
    setup_env()
    from vllm import SamplingParams

    from uhead_vllm.capture.protocol import RequestTag
    from uhead_vllm.generation import build_llm

    from .workload import counting_prompts, tiny_llama

    model = tiny_llama()
    llm = build_llm(model, (0, 2, 4), capture_dtype="bfloat16", enforce_eager=True, block_size=32,
                    kv_cache_memory_bytes=512 << 20, max_model_len=512, max_num_seqs=args.prompts * args.n,
                    max_num_batched_tokens=8192, seed=0)
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer(text)["input_ids"]} for text in counting_prompts(args.prompts)]
    per_sample = [p for p in prompts for _ in range(args.n)]
    one = SamplingParams(n=1, max_tokens=2, temperature=1.0, ignore_eos=True)

    def tagged(skip_clone: bool) -> list:
        params = []
        for k in range(len(per_sample)):
            child = copy.copy(one)
            child.extra_args = RequestTag(1000 + k, k % args.n).to_extra_args()
            child.skip_clone = skip_clone
            params.append(child)
        return params

    forms = {
        "plain, n per prompt": lambda: (prompts, SamplingParams(n=args.n, max_tokens=2, temperature=1.0, ignore_eos=True)),
        "per sample, vLLM deep-copies params": lambda: (per_sample, tagged(False)),
        "per sample, skip_clone (the generator's)": lambda: (per_sample, tagged(True)),
    }
    engine = llm.llm_engine
    add = engine.add_request
    spent: list[float] = []

    def timed_add(*a, **k):
        t0 = time.perf_counter()
        try:
            return add(*a, **k)
        finally:
            spent.append(time.perf_counter() - t0)

    engine.add_request = timed_add
    runs: dict[str, list[float]] = {name: [] for name in forms}
    for rep in range(args.reps + 1):
        for name, make in forms.items():
            inputs, params = make()
            spent.clear()
            llm.generate(inputs, params, use_tqdm=False)
            if rep:  # the first round warms vLLM's caches
                runs[name].append(1e3 * sum(spent))
        print(f"[request_adding] {rep}: " + ", ".join(f"{n} {v[-1]:.1f} ms" for n, v in runs.items() if v), flush=True)
    median = {name: statistics.median(v) for name, v in runs.items()}
    result = {"commit": provenance.commit(),
              "command": "python -m experiments.bench.request_adding " + shlex.join(sys.argv[1:] if argv is None else argv),
              "prompts": args.prompts, "n": args.n, "runs_ms": runs, "median_ms": median}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "request_adding.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Time for vLLM to accept one call's requests ({args.prompts} prompts x n={args.n}, "
             "tiny Llama, engine core in process, CPU)", "",
             f"commit `{result['commit']}`, command `{result['command']}`; medians of {args.reps} calls after "
             "a warm-up, the sum of `add_request` over the call's requests", "",
             "| request form | ms |", "|---|---:|"]
    lines += [f"| {name} | {ms:.1f} |" for name, ms in median.items()]
    (OUT / "request_adding.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
