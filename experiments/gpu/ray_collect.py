"""Ray collection on GPUs: the same ``collect`` job on one engine actor (one GPU) and on one actor
per GPU; the datasets are compared and rows/s reported for each.

A random-weight SmolLM2-shaped model (weights saved once, so every actor loads the same ones) with
the carried tokenizer, bf16, CUDA graphs, greedy, a question file of arithmetic questions (graded
by the number, so nothing but this project is needed on the actors). Writes ``ray-gpu.json`` and
``ray-gpu.md`` to ``--out``.

    python -m experiments.gpu.ray_collect --tokenizer .gpu/tok --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ENGINE = {"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.5,
          "kv_cache_memory_bytes": 8 << 30, "max_num_seqs": 256, "max_model_len": 1024, "block_size": 16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--questions", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cpu", action="store_true", help="dry run of this script on CPU (1 and 2 CPU actors)")
    args = ap.parse_args()

    import ray
    import torch
    import vllm

    from experiments.gpu.models import build_model
    from uhead_vllm.scaleout import RayOptions
    from uhead_vllm.scoring.recipe import GenerationRecipe
    from uhead_vllm.study.collect import collect, plan_job
    from uhead_vllm.study.data import compare_datasets

    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "ray-collect"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = build_model(tmp / "smollm2-random", "smollm2", Path(args.tokenizer), save_weights=True)
    qfile = tmp / "questions.jsonl"
    qfile.write_text("".join(json.dumps({"question": f"What is {a} + {3 * a % 97}?", "answer": str(a + 3 * a % 97)}) + "\n"
                             for a in range(args.questions)))
    recipe = GenerationRecipe("steps_plain", args.max_tokens, 0.0, 10, "line", 0, 1)
    gpus = 2 if args.cpu else torch.cuda.device_count()
    engine, per_gpu = ({"dtype": "float32", "enforce_eager": True}, 0) if args.cpu else (ENGINE, 1)
    ray.init(num_gpus=0 if args.cpu else gpus, include_dashboard=False, log_to_driver=True, logging_level="ERROR")
    runs: dict[int, dict[str, Any]] = {}
    paths: dict[int, Path] = {}
    try:
        for replicas in sorted({1, gpus}):
            job = plan_job(tmp / f"data-{replicas}gpu", [f"file:{qfile}"], model, [0, 15, 30], recipe,
                           batch_size=args.batch_size, engine=engine)
            paths[replicas], run = collect(job, ray=RayOptions(replicas=replicas, gpus_per_replica=per_gpu),
                                           progress=False)
            runs[replicas] = run
            print(json.dumps({k: v for k, v in run.items() if k != "resumed_units"}), flush=True)
    finally:
        ray.shutdown()
    result = {"gpu": "CPU dry run" if args.cpu else torch.cuda.get_device_name(0), "gpus": gpus, "vllm": vllm.__version__, "torch": torch.__version__,
              "ray": ray.__version__, "commit": os.environ.get("UHEAD_COMMIT", ""),
              "command": "python -m experiments.gpu.ray_collect " + " ".join(sys.argv[1:]),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "engine": engine,
              "workload": {"questions": args.questions, "batch_size": args.batch_size, "max_tokens": args.max_tokens,
                           "layers": [0, 15, 30], "model": "random-weight SmolLM2-135M shape, bf16"},
              "runs": runs}
    if len(paths) == 2:
        result["comparison"] = compare_datasets(paths[1], paths[gpus])
        result["scaling_steady"] = runs[gpus]["rows_per_s_steady"] / runs[1]["rows_per_s_steady"]
        result["scaling_wall"] = runs[gpus]["rows_per_s"] / runs[1]["rows_per_s"]
    out = Path(args.out)
    (out / "ray-gpu.json").write_text(json.dumps(result, indent=1))
    lines = [f"# collect on Ray, one engine actor per GPU ({result['gpu']} x{gpus}, vLLM {result['vllm']}, "
             f"Ray {result['ray']})", "", f"commit `{result['commit']}`, `{result['command']}`, {result['time']}; "
             f"{args.questions} questions, {args.batch_size} per unit, greedy, max {args.max_tokens} tokens, "
             "layers 0/15/30, random-weight SmolLM2 shape, bf16, CUDA graphs.", "",
             "| GPUs (actors) | rows | wall incl. engine start | rows/s wall | busiest actor in units | rows/s steady |",
             "|---|---|---|---|---|---|"]
    for n, r in runs.items():
        lines.append(f"| {n} | {r['rows']} | {r['seconds']:.1f} s | {r['rows_per_s']:.0f} | "
                     f"{r['busiest_replica_s']:.1f} s | {r['rows_per_s_steady']:.0f} |")
    if "comparison" in result:
        lines += ["", f"Scaling {gpus} vs 1 GPU: **{result['scaling_steady']:.2f}x** steady-state, "
                  f"{result['scaling_wall']:.2f}x wall. Datasets identical: **{result['comparison']['identical']}** "
                  f"({json.dumps(result['comparison'])})."]
    (out / "ray-gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
