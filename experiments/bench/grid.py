"""How capture's cost grows with the work: plain vLLM vs capture in one run, over a grid.

Axes: prompt length (tokens), samples per prompt ``n``, captured layers (1 / 3 / all; one capturing
engine per count, built in turn beside one plain engine that lives through the run), and the
generator's capture window (``"all"`` rows, today's contract, or ``"generated"`` rows only: the
``window`` keyword of ``VllmHiddenStatesGenerator.generate``; a mode the installed generator does
not accept is skipped with a message, never timed as something else). Two more ways on request
(``--modes``): ``untagged``, the capturing engine asked without capture tags (the set-up's own
cost), and ``scores``, an engine that reduces the generated rows to a head's inputs on the device. Each call generates
``--sequences`` sequences (``sequences // n`` prompts of random token ids, unique per prompt, each
``n`` times) of ``--max-tokens`` tokens with ``ignore_eos``. Per cell the ways (plain, then each
mode) run ``--reps`` times, alternating in a rotated order, after one untimed short run of each;
the prefix cache (and the row store) is reset before every run, so every run does the same work.

Reported per cell: throughput capture / plain (ratio of median seconds, and the median of
per-repeat pairs), rows returned (every sample's window, shared prompt rows counted per sample) and
bytes crossing to the host per call (the generator's ``bytes_to_host`` counter where it keeps one,
else what its fetches handed over: the capture RPC's payload or the rows placed straight into the
caller's buffer), next to the floor: distinct rows x
layers x hidden x 2 B, where distinct rows are each prompt's rows once plus every sample's own
generated rows (``"all"``), or the generated rows alone (``"generated"``); rows of the last sampled
token are never computed and are not counted.

    # on the GPU machine (vLLM's engine-core processes: two engines share no interpreter)
    VLLM_ENABLE_V1_MULTIPROCESSING=1 python -m experiments.bench.grid --shape llama8b --tokenizer .gpu/tok --out $OUT/grid --quick
    VLLM_ENABLE_V1_MULTIPROCESSING=1 python -m experiments.bench.grid --shape llama8b --layers 3 --tokenizer .gpu/tok --out ...
    VLLM_ENABLE_V1_MULTIPROCESSING=1 python -m experiments.bench.grid --shape llama8b --layers 3 --prompt-tokens 100 1000 4000 \
        --n 4 --modes all generated untagged scores --tokenizer .gpu/tok --out ...   # every way, n=4
    # on a CPU (a smoke run: tiny model, tiny numbers)
    python -m experiments.bench.grid --model .cache/tiny_models/llama-v1 --cpu --prompt-tokens 16 48 --n 1 2 \\
        --layers 1 all --sequences 4 --max-tokens 4 --reps 1 --out /tmp/grid

Expected on one H100 (llama8b; an engine build ~90 s): ``--quick`` (3 layers; prompts 100 / 1,000 /
4,000 at n=4 and 1,000 at n=16; 3 reps) ~4.5 min; the full grid for one shape and one layer count
(9 cells) ~7 min, so the full grid is six calls (``--shape`` x ``--layers``), or smollm2's three in
one (its engines build in ~40 s, its runs are 3-5x shorter).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from experiments import provenance

from .env import REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "experiments" / "results" / "bench-grid"
MODES = ("all", "generated")
#: ways beyond the generator's modes: "untagged" asks the capturing engine as plain vLLM is asked
#: (no capture tags, so nothing is recorded): what the engine's capture set-up alone costs (the
#: layers' aux outputs in its graphs, the runner's wrappers), apart from recording and fetching;
#: "scores" is an engine of its own that reduces each generated row to a head's inputs on the
#: device (``build_llm(token_inputs=...)``, what ``serve --scores-on-device`` runs), so only
#: D float32 a row leave it
WAYS = MODES + ("untagged", "scores")
#: a capturing run's wall time split (experiments/bench/engines.py): inside vLLM's generate (the
#: forwards and the worker's recording), the generator's fetch, and the rest (plan and assembly)
SPLITS = ("vllm_generate_seconds", "fetch_seconds", "assembly_seconds")
#: --quick: the target cell (1,000-token prompts, n=4) and one step along each axis, 3 layers
QUICK_CELLS = ((100, 4), (1000, 4), (4000, 4), (1000, 16))


def log(msg: str) -> None:
    print(f"[grid {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def layer_set(n_layers: int, count: str) -> tuple[int, ...]:
    """HF hidden-state indices for ``count``: "1" the middle one, "3" first / middle / last, "all"."""
    if count == "all":
        return tuple(range(n_layers + 1))
    k = int(count)
    if k == 1:
        return (n_layers // 2,)
    return tuple(sorted({round(i * n_layers / (k - 1)) for i in range(k)}))


def window_support() -> bool:
    """Whether the installed generator takes a capture ``window`` per call."""
    from uhead_vllm.generation import VllmHiddenStatesGenerator

    return "window" in inspect.signature(VllmHiddenStatesGenerator.generate).parameters


def token_prompts(count: int, length: int, vocab: int, seed: int) -> list[dict]:
    """``count`` prompts of ``length`` random token ids (no two share a first block)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]} for _ in range(count)]


def floor_rows(prompts: int, length: int, n: int, max_tokens: int, mode: str) -> int:
    """Distinct rows of a call: each prompt's rows once (``all``) plus every sample's generated rows."""
    generated = prompts * n * (max_tokens - 1)
    return generated + (prompts * length if mode == "all" else 0)


def engine_settings(args: argparse.Namespace, longest: int) -> dict[str, Any]:
    """One engine's settings. On a GPU: vLLM's defaults (CUDA graphs, Model Runner V2) with the two
    engines of a run sharing the card (0.42 each, the KV cache pinned to the same size); on a CPU
    (``--cpu``) the tests' small engine."""
    max_len = longest + args.max_tokens + 16
    load = {} if args.model else {"load_format": "dummy"}  # a --shape folder has no weights
    if args.cpu:
        return dict(**load, kv_cache_memory_bytes=256 << 20, max_model_len=max_len, max_num_seqs=16, block_size=32,
                    enable_prefix_caching=True, seed=0)
    kv_gib = 8 if args.shape == "llama8b" else 4
    return dict(**load, enable_prefix_caching=True, max_model_len=max_len, max_num_seqs=256,
                gpu_memory_utilization=0.42, kv_cache_memory_bytes=kv_gib << 30, seed=0)


def median_ratio(plain: list[float], capture: list[float]) -> dict[str, float]:
    pairs = [p / c for p, c in zip(plain, capture)]
    return {"throughput_ratio": statistics.median(plain) / statistics.median(capture),
            "pairs_median": statistics.median(pairs), "pairs_min": min(pairs), "pairs_max": max(pairs)}


def stats_of(res: Any) -> dict:
    """Every counter the generator's result carries (the set grows with the generator)."""
    import dataclasses

    st = getattr(res, "stats", None)
    return dataclasses.asdict(st) if st is not None and dataclasses.is_dataclass(st) else {}


def run_group(count: str, args: argparse.Namespace, plain: Any, model: str, dtype: str, n_layers: int, hidden: int,
              vocab: int, cells: list[tuple[int, int]], modes: list[str], windowed: bool,
              done: Callable[[dict], None], token_inputs: tuple[str, int] | None = None) -> None:
    """Build the capturing engine of ``count`` layers, time every cell against ``plain`` (``done``
    gets each finished cell), close it. ``token_inputs`` (a head's token-inputs file and its D):
    the engine reduces rows to the head's inputs, and its one mode is ``"scores"``."""
    from .engines import Config, Runner
    from .workload import Workload

    layers = layer_set(n_layers, count)
    budget = int(args.max_rows_gib * (1 << 30))
    longest = max(length for length, _ in cells)
    t0 = time.perf_counter()
    mode = "eager" if args.eager else "compiled"
    engine = engine_settings(args, longest)
    storage = "bfloat16"
    if token_inputs is not None:
        engine["token_inputs"], storage = token_inputs[0], "float32"
    ours = Runner(Config("ours", mode, storage), model, dtype, layers, engine,
                  [], Workload(1, 1, args.max_tokens), max_capture_bytes=max(budget, 8 << 30))
    build_s = time.perf_counter() - t0
    log(f"capture engine, layers {count} ({len(layers)}): built in {build_s:.0f} s")
    try:
        for length, n in cells:
            prompts = token_prompts(max(1, args.sequences // n), length, vocab, seed=length * 100 + n)
            wl = Workload(len(prompts), n, args.max_tokens)
            row_bytes = len(layers) * hidden * 2 if token_inputs is None else token_inputs[1] * 4
            cell: dict[str, Any] = {"layers": count, "captured_layers": list(layers), "prompt_tokens": length, "n": n,
                                    "prompts": len(prompts), "sequences": len(prompts) * n, "modes": {}, "skipped": {}}
            ways = ["plain"]
            for m in modes:
                if m == "untagged":
                    ways.append(m)
                    continue
                copies = len(prompts) * n * (length + args.max_tokens) * row_bytes  # a row copy per sample
                if m == "all" and copies > budget:
                    cell["skipped"][m] = (f"rows of one call could take {copies / 2**30:.1f} GiB (a prompt copy per "
                                          f"sample) > --max-rows-gib {args.max_rows_gib}")
                    log(f"  prompt {length} n={n}: mode {m} skipped: {cell['skipped'][m]}")
                else:
                    ways.append(m)
            kw = {m: ({"window": "generated" if m == "scores" else m} if windowed else {})
                  for m in modes if m != "untagged"}
            for r in (plain, ours):
                r.prompts = prompts
            warm = Workload(len(prompts), n, min(8, args.max_tokens))
            for w in list(ways):  # untimed: allocations of this batch shape; a mode that fails here is dropped
                if w == "plain":
                    plain.run(warm)
                    continue
                if w == "untagged":
                    ours.run(warm, untagged=True)
                    continue
                try:
                    ours.run(warm, **kw[w])
                except Exception as exc:  # e.g. a window the generator refuses: reported, never timed
                    cell["skipped"][w] = f"failed: {exc!r}"[:400]
                    ways.remove(w)
                    log(f"  prompt {length} n={n}: mode {w} {cell['skipped'][w]}")
            seconds: dict[str, list[float]] = {w: [] for w in ways}
            splits: dict[str, list[dict]] = {w: [] for w in ways}  # per run: inside vLLM's generate, fetch, the rest
            last: dict[str, dict] = {}
            for rep in range(args.reps):
                k = rep % len(ways)
                for w in ways[k:] + ways[:k]:
                    if w in ("plain", "untagged"):
                        seconds[w].append((plain.run(wl) if w == "plain" else ours.run(wl, untagged=True)).seconds)
                        continue
                    keep: list = []
                    res = ours.run(wl, keep, **kw[w])
                    seconds[w].append(res.seconds)
                    splits[w].append({k: res.extra[k] for k in SPLITS if k in res.extra})
                    stats = stats_of(keep[0]) if keep else {}
                    # the generator's own count where it keeps one, else the bytes its fetches handed over
                    to_host = stats.get("bytes_to_host", res.payload_bytes)
                    last[w] = {"rows_returned": res.rows, "rows_forwarded": res.rows_forwarded,
                               "bytes_to_host": to_host, "bytes_fetched": res.payload_bytes,
                               "bytes_returned_views": res.hidden_bytes, "stats": stats}
                    keep.clear()
            cell["plain_seconds"] = seconds["plain"]
            for m in ways[1:]:
                if m == "untagged":
                    cell["modes"][m] = {"seconds": seconds[m], **median_ratio(seconds["plain"], seconds[m]),
                                        "rows_returned": 0, "bytes_to_host": 0, "floor_rows": 0, "floor_bytes": 0,
                                        "bytes_over_floor": 0.0}
                    log(f"  layers {count} prompt {length} n={n} untagged: capture engine/plain "
                        f"{cell['modes'][m]['throughput_ratio']:.3f}")
                    continue
                floor = floor_rows(len(prompts), length, n, args.max_tokens, m)
                cell["modes"][m] = {"seconds": seconds[m], "splits": splits[m],
                                    **median_ratio(seconds["plain"], seconds[m]), **last[m],
                                    "floor_rows": floor, "floor_bytes": floor * row_bytes,
                                    "bytes_over_floor": (last[m]["bytes_to_host"] or 0) / (floor * row_bytes)}
                log(f"  layers {count} prompt {length} n={n} {m}: capture/plain {cell['modes'][m]['throughput_ratio']:.3f}, "
                    f"to host {(last[m]['bytes_to_host'] or 0) / 2**20:.0f} MiB (floor {floor * row_bytes / 2**20:.0f} MiB)")
            done({**cell, "capture_engine_build_s": build_s})
    finally:
        ours.close()


def head_inputs(model: Path, work: Path, layers: tuple[int, ...]) -> tuple[str, int]:
    """A head on ``layers`` (a linear probe fitted on random features, as the serving bench's; its
    numbers mean nothing, its shape is a shipped head's) saved as its token-inputs file, and its D."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from serving_server import build_tiny_head

    from uhead_vllm.heads import load_head

    inputs = load_head(str(build_tiny_head(model, work / f"head-{len(layers)}", list(layers)))).token_inputs()
    path = work / f"token-inputs-{len(layers)}.safetensors"
    inputs.save(str(path))
    return str(path), int(inputs.weight.shape[0])


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Capture cost grid: capture / plain vLLM ({m['model']}, {m['gpu']}, vLLM {m['versions']['vllm']})", "",
             f"commit `{m['commit']}`, `{m['command']}`, {m['time']}; torch {m['versions']['torch']}; "
             f"{m['sequences']} sequences per call x {m['max_tokens']} tokens (ignore_eos), {m['reps']} alternating "
             f"repeats per way; {m['duration_s']:.0f} s in all" + ("" if m["complete"] else " (CUT SHORT: cells so far)")
             + ".", ""]
    lines += [f"- skipped: {s}" for s in m["skipped"]]
    lines += ["", "| layers | prompt tokens | n | mode | capture / plain | pairs (min-max) | rows returned | "
              "to host (MiB) | floor (MiB) | x floor |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c in result["cells"]:
        for mode, r in c["modes"].items():
            lines.append(f"| {c['layers']} | {c['prompt_tokens']} | {c['n']} | {mode} | **{r['throughput_ratio']:.3f}** | "
                         f"{r['pairs_median']:.3f} ({r['pairs_min']:.3f}-{r['pairs_max']:.3f}) | {r['rows_returned']} | "
                         f"{(r['bytes_to_host'] or 0) / 2**20:.1f} | {r['floor_bytes'] / 2**20:.1f} | "
                         + (f"{r['bytes_over_floor']:.2f} |" if r["floor_bytes"] else "- |"))
        for mode, why in c["skipped"].items():
            lines.append(f"| {c['layers']} | {c['prompt_tokens']} | {c['n']} | {mode} | skipped | {why} | | | | |")
    split_rows = [(c, mode, r) for c in result["cells"] for mode, r in c["modes"].items() if r.get("splits")]
    if split_rows:
        lines += ["", "Where a capturing run's time goes (medians, ms): plain vLLM's whole run beside the capturing "
                  "run's time inside vLLM's generate (forwards and recording), its fetch and the rest (plan, assembly).",
                  "", "| layers | prompt tokens | n | mode | plain | inside generate | fetch | rest |",
                  "|---|---:|---:|---|---:|---:|---:|---:|"]
        for c, mode, r in split_rows:
            med = {k: 1e3 * statistics.median(s.get(k, 0.0) for s in r["splits"]) for k in SPLITS}
            lines.append(f"| {c['layers']} | {c['prompt_tokens']} | {c['n']} | {mode} | "
                         f"{1e3 * statistics.median(c['plain_seconds']):.0f} | {med['vllm_generate_seconds']:.0f} | "
                         f"{med['fetch_seconds']:.0f} | {med['assembly_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.grid", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama8b", choices=["smollm2", "llama8b"])
    ap.add_argument("--tokenizer", default=str(REPO_ROOT / ".gpu" / "tok"), help="carried tokenizer folder")
    ap.add_argument("--model", default="", help="a model folder with weights instead of --shape")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help=f"3 layers, cells {QUICK_CELLS}, 3 reps")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[100, 1000, 4000])
    ap.add_argument("--n", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--layers", nargs="+", default=["1", "3", "all"], choices=["1", "3", "all"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(WAYS),
                    help="the generator's capture windows; 'untagged' adds the capturing engine asked without tags")
    ap.add_argument("--sequences", type=int, default=64, help="sequences per call (sequences // n prompts)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-rows-gib", type=float, default=24.0,
                    help="skip an 'all rows' cell whose per-sample row copies could exceed this (host memory)")
    ap.add_argument("--cpu", action="store_true", help="CPU engines (small KV cache, fp32 unless --dtype)")
    ap.add_argument("--eager", action="store_true", help="eager engines (default: CUDA graphs / compiled)")
    ap.add_argument("--dtype", default=None, help="model dtype (default: bfloat16; float32 with --cpu)")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, cells = ["3"], list(QUICK_CELLS)
    else:
        cells = [(p, n) for p in args.prompt_tokens for n in args.n]
    dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    if args.cpu:
        from .env import setup_env

        # engine-core processes as on the GPU: an in-process engine's shutdown (each capturing
        # engine closes after its layer group) would tear down the parallel state the plain one uses
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        setup_env()  # quiet logs, project compile caches, no hub
    elif os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "1":
        sys.exit("on a GPU the grid needs vLLM's engine-core processes (VLLM_ENABLE_V1_MULTIPROCESSING=1)")
    t_start = time.perf_counter()
    import torch
    import vllm

    from .engines import Config, Runner
    from .workload import Workload

    if args.model:
        model = args.model
    else:
        from experiments.gpu.models import build_model

        model = str(build_model(args.out / "work" / f"{args.shape}-random", args.shape, Path(args.tokenizer),
                                save_weights=False))
        # this folder's own config (dummy weights): room for the longest prompt and its answer
        # (the shapes' 4096 positions hold no 4,000-token prompt + 128 tokens)
        path = Path(model) / "config.json"
        own = json.loads(path.read_text())
        own["max_position_embeddings"] = max(own["max_position_embeddings"], 8192)
        path.write_text(json.dumps(own, indent=2))
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    n_layers, hidden, vocab = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["vocab_size"])
    windowed = window_support()
    modes, skipped = list(args.modes), []
    if not windowed and "generated" in modes:
        modes.remove("generated")
        skipped.append("mode 'generated': this uhead_vllm's VllmHiddenStatesGenerator.generate takes no 'window' "
                       "keyword (the capture-windows change is not installed); 'all' runs without the keyword")
        log(skipped[-1])
    longest = max(length for length, _ in cells)
    t0 = time.perf_counter()
    plain = Runner(Config("plain", "eager" if args.eager else "compiled"), model, dtype, (0,),
                   engine_settings(args, longest), [], Workload(1, 1, args.max_tokens))
    plain_build_s = time.perf_counter() - t0
    log(f"plain engine built in {plain_build_s:.0f} s")
    command = "python -m experiments.bench.grid " + shlex.join(argv if argv is not None else sys.argv[1:])
    result = {"meta": {"commit": provenance.commit(), "command": command.strip(), "gpu": provenance.gpu_name(),
                       "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                                    "python": sys.version.split()[0]},
                       "model": args.shape if not args.model else Path(model).name, "dtype": dtype,
                       "engine": engine_settings(args, longest), "plain_engine_build_s": plain_build_s,
                       "sequences": args.sequences, "max_tokens": args.max_tokens, "reps": args.reps,
                       "window_keyword": windowed, "skipped": skipped, "complete": False},
              "cells": []}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"grid-{result['meta']['model']}" + ("-quick" if args.quick else "-layers" + "-".join(args.layers))

    def save(cell: dict | None = None) -> None:  # after every cell: a run cut short keeps its numbers
        if cell is not None:
            result["cells"].append(cell)
        result["meta"].update(time=time.strftime("%Y-%m-%d %H:%M:%S"), duration_s=time.perf_counter() - t_start)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (args.out / f"{name}.md").write_text(markdown(result))

    try:
        for count in args.layers:
            rows_modes = [m for m in modes if m != "scores"]
            try:
                if rows_modes:
                    run_group(count, args, plain, model, dtype, n_layers, hidden, vocab, cells, rows_modes, windowed,
                              save)
                if "scores" in modes:
                    run_group(count, args, plain, model, dtype, n_layers, hidden, vocab, cells, ["scores"], windowed,
                              save, token_inputs=head_inputs(Path(model), args.out / "work", layer_set(n_layers, count)))
            except Exception as exc:  # one layer group failing leaves the others' numbers
                skipped.append(f"layers {count}: failed: {exc!r}"[:600])
                log(skipped[-1])
    finally:
        plain.close()
    result["meta"]["complete"] = True
    save()
    log(f"wrote {args.out / name}.json and .md in {result['meta']['duration_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
