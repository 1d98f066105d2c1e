"""Where a captured generation spends its host time on the GPU machine, next to the same batch
without capture on the same engine: torch.profiler CPU + CUDA-runtime tables of both, so a
synchronising runtime call (``cudaStreamSynchronize``, ``cudaHostAlloc``, ...) or a slow op in
the capture path shows up by name and count.

    python -m experiments.gpu.profile_capture --shape llama8b --tokenizer .gpu/tok --out "$OUT"

Writes ``profile-<shape>.json`` (timings, commit, command) and ``profile-<shape>-{captured,untagged}.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["smollm2", "llama8b"], required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer

    from experiments.bench.engines import Config, Runner
    from experiments.bench.workload import Workload, rendered_prompts
    from experiments.gpu.bench_gpu import MAX_TOKENS, N, engine_settings, fanout_requests
    from experiments.gpu.models import SHAPES, build_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{args.shape}", args.shape,
                        Path(args.tokenizer), save_weights=False)
    n_layers = SHAPES[args.shape]["num_hidden_layers"]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = rendered_prompts(tokenizer, args.prompts)
    wl = Workload(args.prompts, N, MAX_TOKENS)
    runner = Runner(Config("ours", "compiled", "bfloat16"), str(model), "bfloat16", (0, n_layers // 2, n_layers),
                    engine_settings(args.shape), prompts, wl)
    runner.warmup(wl)
    inputs, params = fanout_requests(prompts, tokenizer)

    def untagged() -> float:
        runner.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        runner.llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - t0

    timings: dict[str, list[float]] = {"captured": [], "untagged": []}
    for _ in range(2):  # unprofiled, interleaved: the reference numbers
        timings["captured"].append(runner.run(wl).seconds)
        timings["untagged"].append(untagged())
    for name, fn in (("captured", lambda: runner.run(wl).seconds), ("untagged", untagged)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            seconds = fn()
        timings[f"{name}_profiled"] = [seconds]
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=70)
        (out / f"profile-{args.shape}-{name}.txt").write_text(table)
        print(f"[profile] {name}: {seconds:.3f} s\n" + "\n".join(table.splitlines()[:28]), flush=True)
    meta = {"commit": os.environ.get("UHEAD_COMMIT", "?"), "gpu": torch.cuda.get_device_name(0),
            "command": "python -m experiments.gpu.profile_capture " + " ".join(sys.argv[1:]),
            "sequences": len(inputs), "max_tokens": MAX_TOKENS, "timings": timings}
    (out / f"profile-{args.shape}.json").write_text(json.dumps(meta, indent=1))
    print("[profile] timings", json.dumps(timings), flush=True)
    runner.close()


if __name__ == "__main__":
    main()
