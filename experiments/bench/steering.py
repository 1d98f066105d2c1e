"""Steering and capture-point cost side by side: ``python -m experiments.bench.steering [--tiny] [--reps N]``.

Four configurations, eager, in one process, timed round-robin (order reversed every other
repeat) on fresh prompts each repeat, so neither the prefix cache nor machine drift favours one:

- ``capture``: an engine capturing residual layers, without steering hooks (today's engine);
- ``capture-points``: the same layers plus the four points inside decoder layers (``attn_in``,
  ``attn_out``, ``mlp_in``, ``mlp_out``) at three layers, read by eager hooks (12 more columns);
- ``steer-engine-plain``: an engine built with ``steering=True``, requests not steering (the cost
  of the idle hooks);
- ``steer-engine-steered``: the same engine, every request steering ``mlp_out`` of two layers
  and ``resid_post`` of one, all tokens.

Writes ``experiments/results/bench/steering.{json,md}`` stamped with the commit and command.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from .env import REPO_ROOT, setup_env
from experiments import provenance

OUT = REPO_ROOT / "experiments" / "results" / "bench"
CONFIGS = ("capture", "capture-points", "steer-engine-plain", "steer-engine-steered")
POINTS = ("attn_in", "attn_out", "mlp_in", "mlp_out")


def _prompts(rep: int, n: int) -> list[str]:
    return [f"Question {rep}-{i}: what is {7 * i + rep} + {3 * i + 11}? Think step by step." for i in range(n)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiny", action="store_true", help="tiny random llama instead of the embedded model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    setup_env()
    import torch
    from vllm import SamplingParams

    from uhead_vllm.generation import SMALL_CPU_ENGINE, VllmHiddenStatesGenerator, build_llm

    if args.tiny:
        from .workload import tiny_llama

        model = tiny_llama()
    else:
        from uhead_vllm.models import embedded_model_path

        model = str(embedded_model_path())
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    n_layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    layers = (0, n_layers // 2, n_layers)
    engine = dict(SMALL_CPU_ENGINE)
    gens = {"capture": VllmHiddenStatesGenerator(build_llm(model, layers, **engine))}
    points = [(p, k) for k in (n_layers // 3, n_layers // 2, 2 * n_layers // 3) for p in POINTS]
    gens["capture-points"] = VllmHiddenStatesGenerator(build_llm(model, layers, points=points, **engine))
    gens["steer"] = VllmHiddenStatesGenerator(build_llm(model, layers, steering=True, **engine))
    vec = (0.05 * torch.randn(hidden, generator=torch.Generator().manual_seed(0))).tolist()
    steer = [{"point": "mlp_out", "layer": n_layers // 3, "vector": vec, "scale": 2.0},
             {"point": "mlp_out", "layer": 2 * n_layers // 3, "vector": vec, "scale": 2.0},
             {"point": "resid_post", "layer": n_layers // 2, "vector": vec, "scale": 1.0}]
    base = dict(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    params = {"capture": SamplingParams(**base), "capture-points": SamplingParams(**base),
              "steer-engine-plain": SamplingParams(**base),
              "steer-engine-steered": SamplingParams(**base, extra_args={"uhead_steer": steer})}
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for rep in range(-1, args.reps):  # rep -1 warms every configuration up
        order = CONFIGS if rep % 2 == 0 else tuple(reversed(CONFIGS))
        for c in order:
            gen = gens[c if c in gens else "steer"]
            prompts = _prompts(rep * 10 + CONFIGS.index(c), args.prompts)
            t0, c0 = time.perf_counter(), time.process_time()
            res = gen.generate(prompts, params[c])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            tokens = sum(len(o.outputs[0].token_ids) for o in res.outputs)
            if rep >= 0:
                runs[c].append({"seconds": wall, "cpu_seconds": cpu, "tokens": tokens, "tok_per_s": tokens / wall})
            print(f"[steering bench] rep {rep} {c}: {tokens / wall:.1f} tok/s", file=sys.stderr, flush=True)
    med = {c: statistics.median(r["tok_per_s"] for r in runs[c]) for c in CONFIGS}

    def paired(a: str, b: str) -> float:
        return statistics.median(x["tok_per_s"] / y["tok_per_s"] for x, y in zip(runs[a], runs[b]))

    command = "python -m experiments.bench.steering" + (" " + shlex.join(argv if argv is not None else sys.argv[1:])
                                                         if (argv if argv is not None else sys.argv[1:]) else "")
    result = {
        "git_commit": provenance.commit(), "command": command, "model": Path(model).name,
        "engine": {k: v for k, v in engine.items()}, "layers": list(layers), "points": points,
        "workload": {"prompts": args.prompts, "max_tokens": args.tokens, "greedy": True, "reps": args.reps},
        "steering": [{k: v for k, v in t.items() if k != "vector"} | {"vector_norm": float(torch.tensor(vec).norm())}
                     for t in steer],
        "tok_per_s_median": med, "runs": runs,
        "ratio_steered_vs_plain_same_engine": paired("steer-engine-steered", "steer-engine-plain"),
        "ratio_steered_vs_capture_engine": paired("steer-engine-steered", "capture"),
        "ratio_idle_hooks_vs_capture_engine": paired("steer-engine-plain", "capture"),
        "ratio_points_vs_layers_only": paired("capture-points", "capture"),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "steering.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "steering.md").write_text(_markdown(result))
    del gens
    gc.collect()
    return result


def _markdown(r: dict) -> str:
    w = r["workload"]
    rows = "\n".join(f"| {c} | {r['tok_per_s_median'][c]:.1f} |" for c in CONFIGS)
    return (f"# Steering and capture-point cost\n\nCommit `{r['git_commit']}`, command `{r['command']}`, model {r['model']}, eager, "
            f"fp32, layers {r['layers']} captured, {w['prompts']} prompts x {w['max_tokens']} greedy tokens, "
            f"{w['reps']} interleaved repeats (median).\n\n| configuration | tok/s |\n|---|---:|\n{rows}\n\n"
            f"- steered / plain requests, same engine: **{r['ratio_steered_vs_plain_same_engine']:.3f}x**\n"
            f"- steered requests / engine without steering hooks: {r['ratio_steered_vs_capture_engine']:.3f}x\n"
            f"- idle steering hooks / engine without them: {r['ratio_idle_hooks_vs_capture_engine']:.3f}x\n"
            f"- capture points ({len(r['points'])} sites: {', '.join(POINTS)} at 3 layers) / layers only: "
            f"**{r['ratio_points_vs_layers_only']:.3f}x**\n")


if __name__ == "__main__":
    main()
