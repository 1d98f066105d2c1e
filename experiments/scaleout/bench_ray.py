"""Rows/s of ``collect`` on 1 and 2 Ray engine actors (one CPU each), side by side in one run.

Same job (the embedded model, basic_arithmetic questions, greedy, the study's layers) written by
``--replicas 1`` and ``--replicas 2``; the two datasets are checked to be identical. Reported per
run: wall time including actor start (engine load), and steady-state rows/s = rows / the busiest
actor's time inside units (what more actors buy once engines are up). Writes
experiments/results/scaleout/ray_{1v2}.{json,md} (or ``--out``), stamped with commit and command.

    python -m experiments.scaleout.bench_ray [--questions 96] [--batch-size 12]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from experiments import provenance  # noqa: E402
from uhead_vllm.runtime import set_env_defaults  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(REPO / "experiments/results/scaleout"))
    args = ap.parse_args()
    set_env_defaults(quiet=True)
    import ray

    from uhead_vllm.models import embedded_model_path
    from uhead_vllm.scaleout import RayOptions
    from uhead_vllm.study.data import compare_datasets
    from uhead_vllm.scoring.recipe import GenerationRecipe
    from uhead_vllm.study.collect import collect, plan_job
    from uhead_vllm.study.commands import DEFAULT_LAYERS

    model = embedded_model_path()
    recipe = GenerationRecipe("steps_plain", args.max_tokens, 0.0, 10, "line", 0, 1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_ray_"))
    load_before = os.getloadavg()[0]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    runs, paths = {}, {}
    try:
        for replicas in (1, 2):
            job = plan_job(tmp / f"r{replicas}", [f"basic_arithmetic:{args.questions}:0"], model, DEFAULT_LAYERS,
                           recipe, batch_size=args.batch_size)
            paths[replicas], run = collect(job, ray=RayOptions(replicas=replicas), progress=False)
            runs[replicas] = {"replicas": replicas, "units": run["units"], "rows": run["rows"],
                              "wall_s": round(run["seconds"], 2), "busiest_actor_s": round(run["busiest_replica_s"], 2),
                              "actors_used": run["replicas_used"], "rows_per_s_wall": round(run["rows_per_s"], 1),
                              "rows_per_s_steady": round(run["rows_per_s_steady"], 1)}
            print(json.dumps(runs[replicas]), flush=True)
    finally:
        ray.shutdown()
    identical = compare_datasets(paths[1], paths[2])["identical"]
    shutil.rmtree(tmp, ignore_errors=True)
    meta = {"commit": provenance.commit(),
            "command": "python -m experiments.scaleout.bench_ray " + " ".join(sys.argv[1:]),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": f"{os.cpu_count()} CPU cores",
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
            "questions": args.questions, "batch_size": args.batch_size, "max_tokens": args.max_tokens,
            "model": "embedded SmolLM2-135M-Instruct, fp32 CPU engine, layers " + str(list(DEFAULT_LAYERS))}
    scaling = {"steady": runs[2]["rows_per_s_steady"] / runs[1]["rows_per_s_steady"],
               "wall": runs[2]["rows_per_s_wall"] / runs[1]["rows_per_s_wall"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray_1v2.json").write_text(json.dumps({**meta, "runs": runs, "scaling": scaling,
                                                  "datasets_identical": identical}, indent=2) + "\n")
    lines = ["# collect on Ray: 1 vs 2 engine actors (1 CPU each)", "",
             f"commit `{meta['commit']}`, `{meta['command']}`, {meta['time']}; {meta['machine']}; {meta['model']}; "
             f"{args.questions} basic_arithmetic questions, greedy, max {args.max_tokens} tokens, "
             f"{args.batch_size} questions per unit. 1-min load average before/after: "
             f"{meta['load_average_1min']['before']:.2f}/{meta['load_average_1min']['after']:.2f} "
             "(other work shares this VM's 2 cores).", "",
             "| actors | units | rows | wall (incl. engine start) | rows/s wall | busiest actor in units | rows/s steady |",
             "|---|---|---|---|---|---|---|"]
    for r in runs.values():
        lines.append(f"| {r['replicas']} | {r['units']} | {r['rows']} | {r['wall_s']} s | {r['rows_per_s_wall']} | "
                     f"{r['busiest_actor_s']} s | {r['rows_per_s_steady']} |")
    lines += ["", f"Scaling 2 vs 1 actors: **{scaling['steady']:.2f}x** steady-state, {scaling['wall']:.2f}x wall. "
              f"Datasets identical: **{identical}**."]
    (out / "ray_1v2.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
