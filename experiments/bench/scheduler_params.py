"""Does a SamplingParams object per request slow vLLM's scheduler? ``python -m experiments.bench.scheduler_params``.

The generator sends every sample as a request of its own with its own ``SamplingParams`` copy
(the copy carries the sample's capture tag in ``extra_args``); plain vLLM shares one object among
the samples of an n>1 request. py-spy on an H100 host (42642d0) showed vLLM's scheduler running
longer beside capture at 256 sequences, and the scheduler reads each request's parameters every
step. Here, pure vLLM on this machine's CPU (in-process, a tiny random Llama): 256 requests x 48
tokens with one shared object, then with a copy per request carrying a tag, alternating; the
scheduler's ``schedule`` and ``update_from_output`` are timed per call.

Writes ``experiments/results/bench/scheduler_params.{json,md}`` stamped with commit and command.
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
from typing import Any

from experiments import provenance

from .env import REPO_ROOT

OUT = REPO_ROOT / "experiments" / "results" / "bench"
REQUESTS, TOKENS = 256, 48
TIMED = ("schedule", "update_from_output")


def _timed_scheduler(spent: dict[str, float]) -> None:
    """Add each call's seconds of the scheduler's two per-step methods to ``spent``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    for name in TIMED:
        original = getattr(Scheduler, name)

        def timed(self: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start

        setattr(Scheduler, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="calls of each way (the first of each untimed)")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process, so it can be timed
    from vllm import LLM, SamplingParams

    from uhead_vllm._testing import build_tiny_model

    spent = {name: 0.0 for name in TIMED}
    _timed_scheduler(spent)
    model = build_tiny_model(REPO_ROOT / ".cache" / "bench_models" / "llama", "llama")
    llm = LLM(model=str(model), max_num_seqs=REQUESTS, max_model_len=512, enable_prefix_caching=True, seed=0)
    prompts = [{"prompt_token_ids": [1 + i % 7, 5, 9, 11 + i % 50]} for i in range(REQUESTS // 4) for _ in range(4)]
    shared = SamplingParams(max_tokens=TOKENS, temperature=1.0, ignore_eos=True)

    def per_request() -> list[Any]:
        out = []
        for i in range(REQUESTS):
            child = copy.copy(shared)
            child.extra_args = {"tag": [i, i % 4]}
            out.append(child)
        return out

    runs: dict[str, list[dict[str, float]]] = {"shared": [], "per_request": []}
    for rep in range(args.reps):
        for way in runs:
            params = shared if way == "shared" else per_request()
            llm.reset_prefix_cache()
            for name in spent:
                spent[name] = 0.0
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if rep:
                runs[way].append({"generate": time.perf_counter() - start, **spent})
    medians = {way: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for way, rs in runs.items()}
    meta = {"commit": provenance.commit(), "command": "python -m experiments.bench.scheduler_params "
            + shlex.join(sys.argv[1:]), "requests": REQUESTS, "tokens": TOKENS, "timed_calls": args.reps - 1}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scheduler_params.json").write_text(json.dumps({"meta": meta, "medians": medians, "runs": runs}, indent=1))
    lines = ["# A SamplingParams object per request vs one shared, vLLM's scheduler (CPU, in-process)", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`; {REQUESTS} requests x {TOKENS} tokens, "
             f"medians of {args.reps - 1} calls per way, alternating.", "",
             "| way | generate s | `schedule` s | `update_from_output` s |", "|---|---:|---:|---:|"]
    lines += [f"| {way} | {m['generate']:.3f} | {m['schedule']:.4f} | {m['update_from_output']:.4f} |"
              for way, m in medians.items()]
    (OUT / "scheduler_params.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
