"""Where capture's cost inside vLLM's ``generate`` comes from, on one capturing engine.

Three ways of running the same batch alternate on one engine (CUDA graphs, Model Runner V2,
vLLM's default engine-core process), so process-to-process noise cancels:

- ``untagged``: the generator's request form (token ids, one n=1 request per sample) without
  capture tags: the recorder sees the requests but records nothing;
- ``kept``: capture, rows kept in the worker's pinned memory and fetched after the pass (no row
  destination, so no placer thread beside the engine);
- ``placed``: capture as shipped, rows written into the caller's shared buffer while vLLM runs.

``kept`` - ``untagged`` prices the engine thread's recording; ``placed`` - ``kept`` the placer
thread (and the shared-memory destination) during the pass.

    VLLM_ENABLE_V1_MULTIPROCESSING=1 python -m experiments.gpu.ablate_capture --shape smollm2 \\
        --tokenizer .gpu/tok --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments import provenance

REPO = Path(__file__).resolve().parents[2]
SEQUENCES = (16, 256)  # prompts x N samples
REPS = 7


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["smollm2", "llama8b"], required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    import vllm
    from transformers import AutoTokenizer

    import uhead_vllm.generation.generator as generator_module
    from experiments.bench.engines import Config, Runner
    from experiments.bench.workload import Workload, rendered_prompts
    from experiments.gpu.bench_gpu import MAX_TOKENS, N, engine_settings, fanout_requests, freeze_startup_heap
    from experiments.gpu.models import SHAPES, build_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(build_model(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{args.shape}", args.shape,
                            Path(args.tokenizer), save_weights=False))
    n_layers = SHAPES[args.shape]["num_hidden_layers"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = rendered_prompts(tokenizer, max(SEQUENCES) // N)
    big = Workload(max(SEQUENCES) // N, N, MAX_TOKENS)
    runner = Runner(Config("ours", "compiled", "bfloat16"), model, "bfloat16", (0, n_layers // 2, n_layers),
                    engine_settings(args.shape), prompts, big)
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

    def captured(wl: Workload, placed: bool) -> dict[str, Any]:
        # No room for a destination buffer: the generator lets the worker keep the rows instead.
        generator_module._physical_memory = physical_memory if placed else (lambda: 0)
        try:
            r = runner.run(wl)
        finally:
            generator_module._physical_memory = physical_memory
        return {"seconds": r.seconds, **r.extra}

    ways = {"untagged": untagged, "kept": lambda wl: captured(wl, False), "placed": lambda wl: captured(wl, True)}
    result: dict[str, Any] = {}
    for seqs in SEQUENCES:
        wl = Workload(seqs // N, N, MAX_TOKENS)
        runs: dict[str, list[dict]] = {name: [] for name in ways}
        for _ in range(REPS):
            for name, way in ways.items():
                runs[name].append(way(wl))
        result[str(seqs)] = {
            name: {"median_seconds": float(np.median([r["seconds"] for r in rs])),
                   "median_generate_seconds": float(np.median([r.get("vllm_generate_seconds", r["seconds"]) for r in rs])),
                   "median_record_seconds": float(np.median([r.get("record_seconds", 0.0) for r in rs])),
                   "median_place_seconds": float(np.median([r.get("place_seconds", 0.0) for r in rs])),
                   "runs": rs}
            for name, rs in runs.items()}
    runner.close()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    meta = {"gpu": gpu, "vllm": vllm.__version__, "commit": provenance.commit(),
            "command": " ".join(["python -m experiments.gpu.ablate_capture", *sys.argv[1:]]),
            "engine_process": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"), "reps": REPS}
    (out / f"ablate-{args.shape}.json").write_text(json.dumps({"meta": meta, "results": result}, indent=1))
    lines = [f"# Capture's cost inside generate, {args.shape} shape ({meta['gpu']}, vLLM {meta['vllm']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`; medians of {REPS} alternating runs on one engine.", "",
             "| sequences | way | total s | inside generate s | engine-thread record s | placer s |",
             "|---|---|---|---|---|---|"]
    for seqs, ways_result in result.items():
        for name, r in ways_result.items():
            lines.append(f"| {seqs} | {name} | {r['median_seconds']:.3f} | {r['median_generate_seconds']:.3f} | "
                         f"{r['median_record_seconds']:.3f} | {r['median_place_seconds']:.3f} |")
    (out / f"ablate-{args.shape}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
