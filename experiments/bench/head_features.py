"""Head features of a best-of-n step's candidates: per candidate vs batched, side by side.

The value study scores thousands of candidates per step (500 questions x 8); ``HeadScorer.features``
runs a few tensor operations per candidate, ``features_batch`` a few per 1024. Synthetic candidates
of the study's shape (rows in one huge-page row buffer as the generator's destination, 3 captured
layers of 576, 11 scored tokens each, vLLM-like logprob dicts), repeated and interleaved; the
results (medians and their ratio, commit, command) go to ``--out``. Threads: torch's setting unless
``--threads``.

    .venv/bin/python -m experiments.bench.head_features --out experiments/results/bench
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from experiments import provenance
from uhead_vllm.features import FeatureRecipe, StepSpan
from uhead_vllm.generation.host_memory import host_buffer
from uhead_vllm.heads import LinearProbeHead
from uhead_vllm.runtime import set_threads
from uhead_vllm.thinkbooster.scorers import CandidateStep, HeadScorer


def _candidates(n: int, tokens: int = 12, layers: tuple[int, ...] = (14, 18, 22), hidden: int = 576) -> list:
    slot = 64
    buffer = host_buffer((n * slot, len(layers), hidden), torch.float32)
    buffer.normal_(generator=torch.Generator().manual_seed(0))
    lp = SimpleNamespace
    logprobs = [{t: lp(logprob=-0.1 * t) for t in range(10)} for _ in range(tokens)]
    return [CandidateStep(list(range(tokens)), StepSpan(0, tokens - 1),
                          buffer[i * slot + slot - tokens : (i + 1) * slot], layers, logprobs) for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--candidates", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    set_threads(args.threads)
    steps = _candidates(args.candidates)
    results = {}
    for topk in (0, 3):
        head = HeadScorer(LinearProbeHead(recipe=FeatureRecipe([14, 18, 22], logprob_topk=topk)))
        times: dict[str, list[float]] = {"per_candidate": [], "batched": []}
        for r in range(args.repeats):
            order = ("per_candidate", "batched") if r % 2 == 0 else ("batched", "per_candidate")
            for name in order:
                start = time.perf_counter()
                got = [head.features(s) for s in steps] if name == "per_candidate" else head.features_batch(steps)
                times[name].append(time.perf_counter() - start)
            assert len(got) == len(steps)
        med = {k: statistics.median(v) for k, v in times.items()}
        results[f"logprob_topk={topk}"] = {"seconds": times, "median_s": med,
                                           "speedup": med["per_candidate"] / med["batched"]}
        print(f"logprob_topk={topk}: per candidate {med['per_candidate']:.3f} s, batched {med['batched']:.3f} s "
              f"({med['per_candidate'] / med['batched']:.1f}x) for {args.candidates} candidates", flush=True)
    meta = {"commit": provenance.commit(), "command": "python -m experiments.bench.head_features " + " ".join(sys.argv[1:]),
            "platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "candidates": args.candidates, "repeats": args.repeats}
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "head_features.json"
    target.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print("wrote", target)


if __name__ == "__main__":
    main()
