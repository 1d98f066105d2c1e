"""GPU throughput of capture, side by side in one run: plain vLLM with CUDA graphs, uhead_vllm
capture with CUDA graphs, plain eager, and the common approach (eager hooks + pickle).

Random-weight models of real shapes (vLLM's dummy weights; values do not matter for speed), bf16,
chat prompts × n=4 × 128 tokens with ``ignore_eos`` so every configuration generates the same
tokens. Each configuration runs in its own process, one after another (vLLM reads the runner choice
once per process); the parent writes ``bench-<shape>.json`` and ``bench-<shape>.md`` with ratios.

``--paired`` instead builds plain vLLM with graphs and capture with graphs side by side in one
process (each with vLLM's default engine-core process, Model Runner V2) and alternates their runs,
PAIRED_REPS of each per batch size: the ratio of the medians is then free of the process-to-process
speed differences (±20% on the lent machines) that the one-process-per-configuration ratios carry.
``--paired --split`` adds two alternating series, the generator's request form sent untagged to
each engine: the request form's price on the plain engine, the aux outputs' on the capturing one;
``--aa`` a second plain engine (the ratios' noise floor; with ``--variant same`` a second
capturing engine too, and the report pools two engines of each kind); ``--pin`` gives this process
and each engine-core process cores of their own (without it, identical engines differed by up to 9% on a
lent H100 host; with it by ≤ 2.5%, by up to 16% on noisy hosts, where the engines' own cores
differ: ``--pin together`` puts every engine on the same cores, which take turns as the runs do;
``--pin fastest`` probes the cores first and uses the quickest: a host's cores differed up to 2x);
``--variant NAME`` (repeatable) one more capturing engine built another way
(:data:`CAPTURE_VARIANTS`: eager step copies, rows placed only at the fetch, batches of up to 64
steps). ``--rounds K`` repeats the whole paired run K times, each in a fresh process with fresh
engines, and reports the median of the rounds' ratios (identical engines of one run differed by
4-8%: a single run measures its processes as much as capture).

    python -m experiments.gpu.bench_gpu --shape smollm2 --tokenizer .gpu/tok --out "$OUT"
    VLLM_ENABLE_V1_MULTIPROCESSING=1 python -m experiments.gpu.bench_gpu --shape llama8b --paired [--split --aa] --pin ...
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from experiments import provenance
from experiments.bench.processes import EngineProcesses
from uhead_vllm.envs import FILE_WRITES_ENV
from uhead_vllm.envs import PLACE_AT_DRAIN_ENV
from uhead_vllm.envs import STEP_BATCH_ENV, STEP_GRAPHS_ENV
from uhead_vllm.envs import SETTLE_PLACEMENT_ENV

REPO = Path(__file__).resolve().parents[2]
BATCHES = (4, 16, 64)  # prompts per call; x n=4 samples
N, MAX_TOKENS, REPS = 4, 128, 2
PAIRED_REPS = 7  # alternating runs of each engine per batch size in --paired mode


def configs(shape: str, n_layers: int) -> list[dict[str, Any]]:
    """Name, kind (plain/ours/common), mode, runner and captured layers of each configuration."""
    three = [0, n_layers // 2, n_layers]
    out = [
        dict(name="plain-graphs", kind="plain", mode="compiled", runner="v2", layers=[]),
        dict(name="ours-graphs", kind="ours", mode="compiled", runner="v2", layers=three),
        dict(name="plain-eager", kind="plain", mode="eager", runner="v2", layers=[]),
        dict(name="common-eager", kind="common", mode="eager", runner="v1", layers=three),
        dict(name="plain-graphs-v1", kind="plain", mode="compiled", runner="v1", layers=[]),
        dict(name="ours-graphs-v1", kind="ours", mode="compiled", runner="v1", layers=three),
    ]
    if shape == "smollm2":
        out += [
            dict(name="ours-graphs-1layer", kind="ours", mode="compiled", runner="v2", layers=[n_layers // 2]),
            dict(name="ours-graphs-4layers", kind="ours", mode="compiled", runner="v2",
                 layers=[0, n_layers // 3, 2 * n_layers // 3, n_layers]),
            dict(name="ours-graphs-all", kind="ours", mode="compiled", runner="v2", layers=list(range(n_layers + 1))),
        ]
    return out


def captured_layers(n_layers: int, count: int) -> tuple[int, ...]:
    """``count`` HF layer indices spread over 0..n_layers (1: the middle one; 3: first, middle,
    last, as the default; 0 or more than there are: all)."""
    if count <= 0 or count > n_layers:
        return tuple(range(n_layers + 1))
    if count == 1:
        return (n_layers // 2,)
    return tuple(sorted({round(i * n_layers / (count - 1)) for i in range(count)}))


def engine_settings(shape: str, tp: int = 1, paired: bool = False, engines: int = 2) -> dict[str, Any]:
    """One engine's settings; ``paired``: ``engines`` engines share the GPU (the largest batch needs
    ~6.3 GB of KV cache at the 8B shape, 256 sequences of ~190 tokens). vLLM refuses to start an
    engine while less than its ``gpu_memory_utilization`` of the card is free (the KV cache is sized
    by ``kv_cache_memory_bytes``): a third 8B engine (~27 GB each) did not start at 0.42 (an H100 run),
    so beyond two the 8B shape's engines share 0.85 of the card."""
    kv_gib = (8 if shape == "llama8b" else 4) if paired else (16 if shape == "llama8b" else 8)
    share = 0.85 / engines if shape == "llama8b" and engines > 2 else 0.42
    return dict(load_format="dummy", enable_prefix_caching=True, max_model_len=1024, max_num_seqs=256,
                gpu_memory_utilization=share if paired else 0.85, kv_cache_memory_bytes=kv_gib << 30,
                seed=0, tensor_parallel_size=tp,
                compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]})


def freeze_startup_heap() -> None:
    """Keep the garbage collector off the start-up heap (engines, tokenizer, libraries), as vLLM's
    engine core and API server do after start-up: otherwise an automatic full collection that
    lands in a timed run costs ~0.5 s here (gc.collect() of this process on the H100 host),
    whichever configuration it hits."""
    gc.collect()
    gc.freeze()


def child(spec: dict[str, Any], model: str, shape: str, tp: int = 1) -> dict[str, Any]:
    """Build one engine, warm it up, time every batch size REPS times."""
    sys.path.insert(0, str(REPO))
    from experiments.bench.engines import Config, Runner
    from experiments.bench.workload import Workload, rendered_prompts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = rendered_prompts(tokenizer, max(BATCHES))
    cfg = Config(spec["kind"], spec["mode"], "bfloat16" if spec["kind"] == "ours" else None)
    layers = tuple(spec["layers"]) or (0,)
    big = Workload(max(BATCHES), N, MAX_TOKENS)
    runner = Runner(cfg, model, "bfloat16", layers, engine_settings(shape, tp), prompts, big)
    result: dict[str, Any] = {**spec, "load_seconds": runner.load_seconds, "batches": {}}
    runner.warmup(big)
    freeze_startup_heap()
    for b in BATCHES:
        wl = Workload(b, N, MAX_TOKENS)
        runs = [runner.run(wl) for _ in range(REPS)]
        result["batches"][str(b * N)] = {
            "tok_per_s": max(r.tok_per_s for r in runs), "seconds": [r.seconds for r in runs],
            "generated_tokens": runs[0].generated_tokens, "rows": runs[0].rows, "extra": runs[-1].extra}
    if spec["kind"] in ("plain", "ours"):
        result["fanout"] = fanout(runner, prompts[: max(BATCHES)], tokenizer,
                                  big if spec["kind"] == "ours" else None)
    if spec["kind"] == "ours":
        result["after_pass_profile"] = after_pass_profile(runner, big)
        result["after_pass_profile_smallest"] = after_pass_profile(runner, Workload(min(BATCHES), N, MAX_TOKENS))
    runner.close()
    return result


def paired_child(model: str, shape: str, n_layers: int, reps: int = PAIRED_REPS, count: int = 3,
                 split: bool = False, aux_only: bool = False, aa: bool = False, pin: str = "",
                 variants: tuple[str, ...] = (), batches: tuple[int, ...] = BATCHES,
                 capture_first: bool = False) -> dict[str, Any]:
    """Plain vLLM with graphs and capture with graphs built side by side, runs alternated, at
    ``batches`` (prompts per call). ``capture_first``: the capturing engines are built before the
    plain ones (``--rounds`` alternates the order, so a bias by build order cancels).

    ``split``: two more series alternate with them, the generator's request form (token ids, one
    n=1 request per sample, no capture tags) sent straight to each engine's vLLM: on the plain
    engine it prices the request form, on the capturing engine the aux outputs in its graphs.
    ``aux_only`` (with ``split``): a third engine with the aux outputs but no step listener
    (``experiments/gpu/aux_only.py``) gets the same untagged requests: the aux outputs' price apart
    from the listener's. ``aa``: a second plain engine, built last, runs like the first: how far
    two identical engines differ here (the noise floor of every ratio, and any bias by build order).
    ``variants``: names of :data:`CAPTURE_VARIANTS`, each one more capturing engine built with
    its environment (read in its engine process), run like the shipped one: a change's worth
    measured in the same run.
    Within each repetition the ways run in a shuffled order (seeded), so no way always runs first
    after a switch of engines. ``pin`` (a :class:`CorePinner` mode): this process gets cores of its
    own, and each engine-core process cores of its own or every engine the same other cores, so no
    engine's threads migrate onto the caller's."""
    sys.path.insert(0, str(REPO))
    from experiments.bench.engines import Config, Runner
    from experiments.bench.phases import time_generator_phases, timed
    from experiments.bench.workload import Workload, rendered_prompts
    from transformers import AutoTokenizer

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "1":
        raise RuntimeError("--paired needs vLLM's engine-core processes (VLLM_ENABLE_V1_MULTIPROCESSING=1): "
                           "two in-process engines would share one Python interpreter")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = rendered_prompts(tokenizer, max(batches))
    layers = captured_layers(n_layers, count)
    big = Workload(max(batches), N, MAX_TOKENS)
    engines = 2 + int(aa) + int(aux_only) + len(variants)
    pinner = CorePinner(engines, pin) if pin else None
    processes = EngineProcesses()
    runners: dict[str, Any] = {}
    variant_env = {f"ours-{v}": CAPTURE_VARIANTS[v][0] for v in variants}
    plain = [("plain-graphs", Config("plain", "compiled"), (0,), {}),
             *((("plain-graphs-b", Config("plain", "compiled"), (0,), {}),) if aa else ())]
    ours = [("ours-graphs", Config("ours", "compiled", "bfloat16"), layers, {}),
            *((name, Config("ours", "compiled", "bfloat16"), layers, env) for name, env in variant_env.items())]
    builds = ours + plain if capture_first else plain[:1] + ours + plain[1:]  # A/A's second plain engine: built last
    for name, config, captured, env in builds:
        with mock.patch.dict(os.environ, env):  # read in the engine process it starts (and per run, here)
            runners[name] = Runner(config, model, "bfloat16", captured, engine_settings(shape, paired=True, engines=engines),
                                   prompts, big)
        pids = processes.note(name)
        if pinner is not None:
            pinner.pin_engine(name, pids)
    aux_llm = None
    if aux_only:
        from uhead_vllm.generation.backends.aux import capture_engine_kwargs
        from vllm import LLM

        aux_llm = LLM(model=model, dtype="bfloat16", **engine_settings(shape, paired=True, engines=engines),
                      **{**capture_engine_kwargs(layers, "bfloat16"),
                         "worker_extension_cls": "experiments.gpu.aux_only.AuxOnlyExtension"})
        pids = processes.note("aux-only-untagged")
        if pinner is not None:
            pinner.pin_engine("aux-only-untagged", pids)
    for runner in runners.values():
        runner.warmup(big)
    times: dict[str, list[float]] = {}  # the capture generator's host phases (experiments/bench/phases.py)
    time_generator_phases(runners["ours-graphs"].gen, times)
    runners["ours-graphs"].llm.generate = timed(times, "llm.generate", runners["ours-graphs"].llm.generate)
    freeze_startup_heap()
    result: dict[str, Any] = {"name": "paired", "layers": list(layers), "reps": reps, "batches": {},
                              "pinned_cores": None if pinner is None else pinner.assigned}
    for b in batches:
        wl = Workload(b, N, MAX_TOKENS)
        extra: dict[str, Any] = {}
        runs = {name: with_env(variant_env.get(name, {}), runner.run) for name, runner in runners.items()}
        ways = runs
        if split:
            inputs, params = fanout_requests(prompts[:b], tokenizer)
            ways = {"plain-graphs": runs["plain-graphs"],
                    "plain-ids": lambda wl, llm=runners["plain-graphs"].llm: untagged_run(llm, inputs, params),
                    "ours-untagged": lambda wl, llm=runners["ours-graphs"].llm: untagged_run(llm, inputs, params),
                    "ours-graphs": runs["ours-graphs"],
                    **{name: runs[name] for name in ("plain-graphs-b", *(f"ours-{v}" for v in variants)) if name in runs}}
            if aux_llm is not None:
                ways["aux-only-untagged"] = lambda wl: untagged_run(aux_llm, inputs, params)
        seconds = {name: [] for name in ways}
        cpu = {name: {"frontend": [], "engine": []} for name in ways}  # CPU seconds per run, by process
        for way in ways.values():  # one full-length untimed run each: the first ones ran 20-40%
            way(wl)                # slower for both (allocator, page cache)
        phases: list[dict[str, float]] = []  # per capture run: seconds per phase
        order: list[list[str]] = []
        shuffle = random.Random(b)
        for _ in range(reps):
            names = list(ways)
            shuffle.shuffle(names)
            order.append(names)
            for name in names:
                way = ways[name]
                times.clear()
                engine = ENGINE_OF_WAY.get(name, name)
                engine_cpu, frontend_cpu = processes.cpu_seconds(engine), time.process_time()
                r = way(wl)
                cpu[name]["frontend"].append(time.process_time() - frontend_cpu)
                cpu[name]["engine"].append(processes.cpu_seconds(engine) - engine_cpu)
                seconds[name].append(r.seconds)
                extra[name] = r.extra
                if name == "ours-graphs":
                    phases.append({k: sum(v) for k, v in times.items()})
        med = {name: float(np.median(v)) for name, v in seconds.items()}
        result["batches"][str(b * N)] = {
            "phase_median_seconds": {k: float(np.median([p.get(k, 0.0) for p in phases])) for k in phases[0]},
            "phase_seconds_per_run": phases,  # in run order: where a slow run spent its time
            "order": order,  # the ways' order in each repetition
            "seconds": seconds, "median_seconds": med, "generated_tokens": wl.generated_tokens,
            "cpu_seconds": cpu,
            "ratio_of_medians": med["plain-graphs"] / med["ours-graphs"],
            "ratio_of_best": min(seconds["plain-graphs"]) / min(seconds["ours-graphs"]),
            "pair_ratios": [p / o for p, o in zip(seconds["plain-graphs"], seconds["ours-graphs"])],
            "extra": extra}
        print(f"[paired] {b * N} seqs: plain/ours {result['batches'][str(b * N)]['ratio_of_medians']:.3f}", flush=True)
    result["after_pass_profile"] = after_pass_profile(runners["ours-graphs"], big)
    for runner in runners.values():
        runner.close()
    if aux_llm is not None:
        aux_llm.llm_engine.engine_core.shutdown()
    return result


class CorePinner:
    """Gives this process and each engine built after it a share of the cores: ``parts`` engines,
    the first share to this process. A measuring aid: with every engine-core process free to run
    anywhere, two identical plain engines differed by 5-9% in median time at 256 sequences on a
    lent H100 host (c27b7b3). Shares are whole physical cores: contiguous ids can be SMT siblings of
    another share's (e.g. 0 and 8 of a 16-thread VM), and an engine sharing physical cores with the
    always-busy caller would be measured slower for that alone.

    ``mode``: ``"apart"``, one share per engine; on hosts whose cores differ in speed those
    engines differed by up to 16% (an H100 run), so ``"together"`` gives every engine the same
    share, all the cores but this process's, and ``"fastest"`` probes the cores, gives this
    process the quickest share and every engine the :data:`FASTEST_SHARE` next."""

    def __init__(self, parts: int, mode: str = "apart"):
        from experiments.gpu.host_probe import physical_cores

        if mode not in ("apart", "together", "fastest"):
            raise ValueError(f"pin mode {mode!r}: expected apart, together or fastest")
        units = physical_cores(sorted(os.sched_getaffinity(0)))
        size = max(1, len(units) // (parts + 1))
        if mode == "fastest":  # quickest physical cores first (probed here, ~0.1 s per core)
            units = fastest_first(units)

        def cores(first: int, end: int) -> list[int]:
            return sorted(c for unit in units[first:end] for c in unit)

        engines = {"apart": [cores((i + 1) * size, (i + 2) * size) for i in range(parts)],
                   "together": [cores(size, len(units))] * parts,  # the runs take turns on them
                   "fastest": [cores(size, size + FASTEST_SHARE)] * parts}[mode]
        self.shares = [cores(0, size)] + engines
        self.assigned: dict[str, list[int]] = {"frontend": self.shares[0]}
        _pin_threads(os.getpid(), self.shares[0])

    def pin_engine(self, name: str, pids: list[int]) -> None:
        """Pin every thread of an engine's processes (:meth:`EngineProcesses.note`) to the next share."""
        share = self.shares[len(self.assigned)]
        for pid in pids:
            _pin_threads(pid, share)
        self.assigned[name] = share


#: Physical cores every engine shares in ``--pin fastest`` (an engine-core process keeps one thread
#: busy and a few more waking per step).
FASTEST_SHARE = 4


def fastest_first(units: list[list[int]]) -> list[list[int]]:
    """Physical cores ordered by the median time of a fixed workload on their first thread,
    quickest first: a lent host's cores differed up to 2x (29-62 ms on one H100 host), and a
    host-bound engine is as fast as the cores it runs on."""
    from experiments.gpu.host_probe import core_times

    times = core_times([unit[0] for unit in units], reps=3)
    return sorted(units, key=lambda unit: float(np.median(times[unit[0]])))


def _pin_threads(pid: int, cores: list[int]) -> None:
    """Every existing thread of ``pid`` onto ``cores`` (threads started later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


def untagged_run(llm: Any, inputs: list[dict], params: Any) -> Any:
    """One timed ``llm.generate`` of requests in the generator's form, without capture tags."""
    from experiments.bench.engines import RunResult

    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")
    gc.collect()
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return RunResult(dt, sum(len(c.token_ids) for o in outs for c in o.outputs), extra={"vllm_generate_seconds": dt})


def with_env(env: dict[str, str], run: Any) -> Any:
    """``run`` with ``env`` set in this process while it runs (a variant read on the engine side)."""
    def wrapped(wl: Any) -> Any:
        with mock.patch.dict(os.environ, env):
            return run(wl)
    return wrapped


#: Optional ways of ``--paired --split`` and their column labels in the report.
#: Capturing engines that ``--variant NAME`` adds: the environment each is built with, its label.
CAPTURE_VARIANTS = {
    "eager-copies": ({STEP_GRAPHS_ENV: "0"}, "capture, step copies eager (no CUDA graphs)"),
    "placed-at-drain": ({PLACE_AT_DRAIN_ENV: "1"}, "capture, rows placed at the fetch (no placer thread during the pass)"),
    "batch-64-steps": ({STEP_BATCH_ENV: "64,4096"}, "capture, batches of 64 steps or 4096 rows"),
    "file-writer": ({FILE_WRITES_ENV: "1"}, "capture, rows written into the row file by the GPU (file_writer.py)"),
    "host-placer": ({FILE_WRITES_ENV: "0"}, "capture, rows placed by the host's placer thread (placer.py)"),
    "settled-placement": ({SETTLE_PLACEMENT_ENV: "1"},
                          "capture, the requests sent once the worker answered place_into"),
    "same": ({}, "a second capturing engine, built like the first (B/B)"),
}
EXTRA_WAYS = {"aux-only-untagged": "aux outputs, no listener, untagged", "plain-graphs-b": "second plain engine (A/A)",
              **{f"ours-{name}": label for name, (_, label) in CAPTURE_VARIANTS.items()}}


#: The engine each split way runs on (every other way runs on the engine of its own name).
ENGINE_OF_WAY = {"plain-ids": "plain-graphs", "ours-untagged": "ours-graphs"}


#: Bootstrap draws for the intervals of the paired report's ratios.
BOOTSTRAP_DRAWS = 4000


def median_ratio_interval(a: list[float], b: list[float], level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """An interval for ``median(a) / median(b)`` (a throughput ratio when ``a`` and ``b`` are seconds
    of the same work): the repetitions resampled with replacement, each keeping its pair of runs (they
    ran next to each other, so a host's drift hits both), ``level`` of the draws' ratios inside. A
    ratio tells 5% apart only where its interval is narrower than that."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.size < 2:
        raise ValueError(f"need two equally long series of at least 2 runs, got {x.size} and {y.size}")
    picks = np.random.default_rng(seed).integers(0, x.size, size=(BOOTSTRAP_DRAWS, x.size))
    return central_interval(np.median(x[picks], axis=1) / np.median(y[picks], axis=1), level)


def central_interval(draws: np.ndarray, level: float) -> tuple[float, float]:
    """The range holding the middle ``level`` of bootstrap ``draws``."""
    tail = (1 - level) / 2
    return float(np.quantile(draws, tail)), float(np.quantile(draws, 1 - tail))


def pooled_ratio(seconds: dict[str, list[float]]) -> tuple[float, tuple[float, float]]:
    """Throughput of capture over plain with two engines of each kind (``--aa --variant same``):
    each repetition's mean of the two plain engines' seconds against its mean of the two capturing
    engines', ratio of the medians and its bootstrap interval. Identical engines in one run differed
    by 4-8% in median (SmolLM2, an H100 run): pooled, one process's own speed weighs half."""
    plain = [(x + y) / 2 for x, y in zip(seconds["plain-graphs"], seconds["plain-graphs-b"])]
    ours = [(x + y) / 2 for x, y in zip(seconds["ours-graphs"], seconds["ours-same"])]
    return float(np.median(plain)) / float(np.median(ours)), median_ratio_interval(plain, ours)


def round_ratio(batch: dict[str, Any]) -> float:
    """One round's throughput ratio, capture over plain, at one batch size: pooled over two engines
    of each kind where the round had them (``--aa --variant same``), else the ratio of medians."""
    s = batch["seconds"]
    return pooled_ratio(s)[0] if "plain-graphs-b" in s and "ours-same" in s else batch["ratio_of_medians"]


def across_rounds(ratios: list[float], level: float = 0.95, seed: int = 0) -> tuple[float, tuple[float, float]]:
    """The median of per-round ratios and a bootstrap interval over rounds: each round has engines of
    its own, so the interval counts the process-to-process spread a single run cannot see."""
    x = np.asarray(ratios, dtype=float)
    if x.size < 2:
        raise ValueError(f"need at least 2 rounds, got {x.size}")
    draws = np.median(x[np.random.default_rng(seed).integers(0, x.size, size=(BOOTSTRAP_DRAWS, x.size))], axis=1)
    return float(np.median(x)), central_interval(draws, level)


def rounds_report(results: list[dict[str, Any]], shape: str, meta: dict[str, Any]) -> str:
    """``--rounds``: each round's ratio (its own engines; every round's details in ``-rK.md``) and
    the median over rounds."""
    done = [r for r in results if "batches" in r]
    lines = [f"# GPU capture throughput over {len(results)} rounds, {shape} shape ({meta['gpu']}, vLLM {meta['vllm']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`", "",
             "Each round builds its own plain and capturing engines in a fresh process (capturing engines "
             "first in every second round) and alternates their runs; a round's ratio is capture / plain "
             "throughput (ratio of medians; pooled over two engines of each kind where the round had them). "
             "Across rounds: the median and a 95% bootstrap interval over rounds.", "",
             "| sequences | rounds | per round | median over rounds | 95% interval |", "|---|---:|---|---:|---|"]
    for seqs in (done[0]["batches"] if done else {}):
        ratios = [round_ratio(r["batches"][seqs]) for r in done]
        cells = ", ".join(f"{x:.3f}" for x in ratios)
        if len(ratios) > 1:
            med, (lo, hi) = across_rounds(ratios)
            lines.append(f"| {seqs} | {len(ratios)} | {cells} | **{med:.3f}** | {lo:.3f}-{hi:.3f} |")
        else:
            lines.append(f"| {seqs} | 1 | {cells} | - | - |")
    for r in results:
        if "batches" not in r:
            lines += ["", f"**{r['name']} failed**: {r.get('error', '?')[-500:]}"]
    return "\n".join(lines) + "\n"


def paired_report(res: dict[str, Any], shape: str, meta: dict[str, Any]) -> str:
    first = next(iter(res["batches"].values()))
    lines = [f"# GPU capture throughput, paired in one process, {shape} shape ({meta['gpu']}, vLLM {meta['vllm']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`", "",
             f"Plain vLLM with CUDA graphs and capture with CUDA graphs (layers {res['layers']}, bf16 rows) built "
             f"side by side, each with vLLM's default engine-core process and Model Runner V2; their runs "
             f"alternate ({'in a shuffled order per repetition' if 'order' in first else 'in a fixed order'}), "
             f"{res.get('reps', PAIRED_REPS)} of each per batch size after one untimed run of each. Capture's time "
             "includes the rows' fetch and assembly into per-sample tensors. A pair: the two runs of one "
             "repetition." + ("" if not res.get("pinned_cores") else " Cores pinned: " + "; ".join(
                 f"{k} {','.join(map(str, v))}" for k, v in res["pinned_cores"].items()) + "."), "",
             "| sequences | plain median s | capture median s | throughput capture / plain (medians) "
             "| 95% interval (bootstrap) | (best of each) | pairs: median (min-max) |",
             "|---|---|---|---|---|---|---|"]
    for seqs, r in res["batches"].items():  # a pair: adjacent runs, so the machine's drift cancels
        med, pairs = r["median_seconds"], r["pair_ratios"]
        lo, hi = median_ratio_interval(r["seconds"]["plain-graphs"], r["seconds"]["ours-graphs"])
        lines.append(f"| {seqs} | {med['plain-graphs']:.3f} | {med['ours-graphs']:.3f} | **{r['ratio_of_medians']:.3f}** "
                     f"| {lo:.3f}-{hi:.3f} | {r['ratio_of_best']:.3f} "
                     f"| {float(np.median(pairs)):.3f} ({min(pairs):.3f}-{max(pairs):.3f}) |")
    extra = {k: label for k, label in EXTRA_WAYS.items() if k in first["median_seconds"]}
    if "plain-graphs-b" in extra:
        lines += ["", "A/A: a second plain engine, built last, against the first (throughput, medians, with a "
                  "95% bootstrap interval; pairs: median (min-max)): the noise floor of the ratios above.", ""]
        for seqs, r in res["batches"].items():
            a, b = r["seconds"]["plain-graphs"], r["seconds"]["plain-graphs-b"]
            pairs = [x / y for x, y in zip(a, b)]
            lo, hi = median_ratio_interval(a, b)
            lines.append(f"- {seqs} sequences: {float(np.median(a)) / float(np.median(b)):.3f} ({lo:.3f}-{hi:.3f}); "
                         f"pairs {float(np.median(pairs)):.3f} ({min(pairs):.3f}-{max(pairs):.3f})")
    if "plain-graphs-b" in extra and "ours-same" in extra:
        lines += ["", "Two engines of each kind (`--aa --variant same`): each repetition's mean of the two plain "
                  "engines against its mean of the two capturing engines, so one process's own speed (its "
                  "build order, its memory layout) weighs half (throughput, medians, 95% bootstrap interval):", ""]
        for seqs, r in res["batches"].items():
            ratio, (lo, hi) = pooled_ratio(r["seconds"])
            s = r["seconds"]
            lines.append(f"- {seqs} sequences: **{ratio:.3f}** ({lo:.3f}-{hi:.3f}); capture B/B "
                         f"{float(np.median(s['ours-graphs'])) / float(np.median(s['ours-same'])):.3f}")
    if "plain-ids" in first["median_seconds"]:
        lines += ["", "The split: the generator's request form (token ids, one n=1 request per sample, no capture "
                  "tags) sent straight to each engine, alternating with the two above (median seconds; ratios are "
                  "throughput against plain vLLM with its own request form).", "",
                  "| sequences | plain | plain, generator's request form | capturing engine, untagged | capture |"
                  + "".join(f" {label} |" for label in extra.values()),
                  "|---|---|---|---|---|" + "---|" * len(extra)]
        for seqs, r in res["batches"].items():
            med = r["median_seconds"]
            lines.append(f"| {seqs} | " + " | ".join(
                f"{med[k]:.3f} ({med['plain-graphs'] / med[k]:.3f})"
                for k in ("plain-graphs", "plain-ids", "ours-untagged", "ours-graphs", *extra)) + " |")
    if "cpu_seconds" in first:
        labels = {"plain-graphs": "plain", "plain-ids": "plain, generator's request form",
                  "ours-untagged": "capturing engine, untagged", "ours-graphs": "capture", **extra}
        lines += ["", "CPU time per call (median ms; in brackets: its CPU time over plain's, more work above 1): this process (vLLM's frontend "
                  "and the generator) and the engine's processes (engine core with its worker). CPU time counts "
                  "work, not waiting for a core; but the engine core's thread spins while it waits for the GPU, "
                  "so the engine's CPU time follows its wall time and measures work only where it does not wait.", "",
                  "| sequences | way | frontend CPU ms | engine CPU ms |", "|---|---|---:|---:|"]
        for seqs, r in res["batches"].items():
            med = {k: {p: float(np.median(v)) for p, v in c.items()} for k, c in r["cpu_seconds"].items()}
            base = med["plain-graphs"]
            for k in (k for k in labels if k in med):
                lines.append(f"| {seqs} | {labels[k]} | " + " | ".join(
                    f"{1e3 * med[k][p]:.0f} ({med[k][p] / base[p]:.3f})" for p in ("frontend", "engine")) + " |")
    if "phase_median_seconds" in first:
        names = list(first["phase_median_seconds"])
        lines += ["", "Capture's phases (median ms per call; wall-clock timers around the generator's steps, "
                  "`llm.generate` includes the engine's recording):", "",
                  "| phase | " + " | ".join(f"{seqs} seqs" for seqs in res["batches"]) + " |",
                  "|---|" + "---:|" * len(res["batches"])]
        for k in names:
            lines.append(f"| {k} | " + " | ".join(f"{1e3 * r['phase_median_seconds'].get(k, 0.0):.1f}"
                                                  for r in res["batches"].values()) + " |")
    largest = max(res["batches"], key=int)
    extras = res["batches"][largest]["extra"]
    for name in ("ours-graphs", *(f"ours-{v}" for v in CAPTURE_VARIANTS)):
        if name in extras:
            lines += ["", f"{name} at {largest} sequences, last run: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in extras[name].items())]
    lines.append("")
    return "\n".join(lines) + "\n"


def fanout(runner: Any, prompts: list[str], tokenizer: Any, captured: Any = None) -> dict[str, Any]:
    """The largest batch sent to ``runner``'s vLLM directly as the capture generator sends it:
    token ids, one n=1 request per sample, no capture tags. On the plain engine this prices the
    request form (vs n=4 requests of text); on the capturing engine it prices the aux outputs in
    the graph without any recording, so plain -> fan-out -> aux engine -> capture splits the cost.

    With ``captured`` (a workload), each repeat also runs it with capture right before the
    untagged pass, on the same engine in the same process: their ratio is free of the
    process-to-process noise that the cross-process ratios carry."""
    inputs, params = fanout_requests(prompts, tokenizer)
    seconds, capture_seconds = [], []
    for _ in range(REPS + (1 if captured is not None else 0)):
        if captured is not None:
            capture_seconds.append(runner.run(captured).seconds)
        run = untagged_run(runner.llm, inputs, params)
        seconds.append(run.seconds)
    result = {"sequences": len(inputs), "seconds": seconds, "tok_per_s": run.generated_tokens / min(seconds)}
    if captured is not None:
        result["interleaved_capture_seconds"] = capture_seconds
        result["interleaved_ratio"] = min(seconds) / min(capture_seconds)
    return result


def fanout_requests(prompts: list[str], tokenizer: Any) -> tuple[list[dict], Any]:
    """``prompts`` in the generator's request form without capture tags: token ids, N copies of
    each prompt, one n=1 request per sample."""
    from vllm import SamplingParams

    ids = [{"prompt_token_ids": tokenizer(p, add_special_tokens=False)["input_ids"]} for p in prompts]
    params = SamplingParams(n=1, max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    return [x for x in ids for _ in range(N)], params


def after_pass_profile(runner: Any, workload: Any, top: int = 25) -> str:
    """cProfile of one captured run with vLLM's generate left out: where the generator's own host
    time goes (preparing requests, checking and assembling rows)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    inner = runner.llm.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        profile.disable()
        try:
            return inner(*args, **kwargs)
        finally:
            profile.enable()

    runner.llm.generate = generate
    try:
        profile.enable()
        runner.run(workload)
        profile.disable()
    finally:
        runner.llm.generate = inner
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def report(results: list[dict[str, Any]], shape: str, meta: dict[str, Any]) -> str:
    by = {r["name"]: r for r in results if "batches" in r}
    tp = meta.get("tensor_parallel_size", 1)
    lines = [f"# GPU capture throughput, {shape} shape{f', TP={tp}' if tp > 1 else ''} ({meta['gpu']}, vLLM {meta['vllm']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`", "",
             "| config | " + " | ".join(f"{b * N} seqs tok/s (x plain-graphs)" for b in BATCHES) + " |",
             "|---|" + "---|" * len(BATCHES)]
    for name, r in by.items():
        cells = []
        for b in BATCHES:
            tps = r["batches"][str(b * N)]["tok_per_s"]
            base = by.get("plain-graphs", {}).get("batches", {}).get(str(b * N), {}).get("tok_per_s")
            cells.append(f"{tps:,.0f} ({tps / base:.3f})" if base else f"{tps:,.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Where the time goes at the largest batch (seconds, last repeat): inside "
              "vLLM's generate (forwards + worker-side capture) and, for capture, the fetch of the rows "
              "and their assembly into per-sample tensors.", "",
              "| config | vLLM generate | fetch | assembly |", "|---|---|---|---|"]
    big = str(max(BATCHES) * N)
    for name, r in by.items():
        extra = r["batches"][big]["extra"]
        cells = [extra.get("vllm_generate_seconds"), extra.get("fetch_seconds"), extra.get("assembly_seconds")]
        lines.append(f"| {name} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    fan = {name: r["fanout"] for name, r in by.items() if "fanout" in r}
    if fan:
        lines += ["", f"The same {big} sequences sent to each engine's vLLM directly as the generator sends "
                  "them (token ids, one n=1 request per sample, no capture tags): on `plain-graphs` the "
                  "price of the request form, on `ours-graphs` the price of the aux outputs in the graph "
                  "without recording. Recording: host seconds on the engine's thread (`record`) and "
                  "in the placer thread beside it (`place`), last repeat.", "",
                  "| config | fan-out tok/s (x plain-graphs) | record s | place s | capture / untagged, one process |",
                  "|---|---|---|---|---|"]
        base = by.get("plain-graphs", {}).get("batches", {}).get(big, {}).get("tok_per_s")
        for name, f in fan.items():
            extra = by[name]["batches"][big]["extra"]
            ratio = f" ({f['tok_per_s'] / base:.3f})" if base else ""
            rec, pl, same = extra.get("record_seconds"), extra.get("place_seconds"), f.get("interleaved_ratio")
            lines.append(f"| {name} | {f['tok_per_s']:,.0f}{ratio} | " + " | ".join(
                "-" if c is None else f"{c:.3f}" for c in (rec, pl, same)) + " |")
    failed = [r for r in results if "batches" not in r]
    for r in failed:
        lines += ["", f"**{r['name']} failed**: {r.get('error', '?')[-500:]}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["smollm2", "llama8b"], required=True)
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json (+ config)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated config names (default: all)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs per engine)")
    ap.add_argument("--paired", action="store_true",
                    help="plain and capture with graphs side by side in one process, runs alternated")
    ap.add_argument("--reps", type=int, default=PAIRED_REPS, help="--paired: timed runs of each engine per batch size")
    ap.add_argument("--layers", type=int, default=3,
                    help="--paired: layers captured, spread from 0 to the last (0 or more than the model has: all)")
    ap.add_argument("--split", action="store_true",
                    help="--paired: also time the generator's request form, untagged, on both engines")
    ap.add_argument("--aux-only", action="store_true",
                    help="--paired --split: also an engine with the aux outputs but no step listener, untagged")
    ap.add_argument("--pin", nargs="?", const="apart", default="", choices=["apart", "together", "fastest"],
                    help="--paired: this process on cores of its own, each engine-core process on cores of "
                         "its own (apart, the default), every engine on the same other cores (together), or "
                         "this process on the quickest cores and every engine on the next quickest (fastest)")
    ap.add_argument("--aa", action="store_true",
                    help="--paired --split: also a second plain engine, built last (A/A: the ratios' noise floor)")
    ap.add_argument("--variant", action="append", default=[], choices=sorted(CAPTURE_VARIANTS),
                    help="--paired --split: also a capturing engine built this way (repeatable; CAPTURE_VARIANTS)")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES),
                    help="--paired: prompts per call (x n=4 samples), e.g. --batches 64 with many --reps: "
                         "on a noisy host, many adjacent pairs at one size say more than a few at each")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--paired: this many rounds, each a fresh process with fresh engines (the build order "
                         "alternating): the report's ratio is then the median over rounds, free of one "
                         "process's own speed")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1 or (args.rounds > 1 and not args.paired):
        ap.error("--rounds takes a count of at least 1, and more than 1 only with --paired")
    out = Path(args.out)
    if args.child:
        spec = json.loads(args.child)
        try:
            if spec["name"].startswith("paired"):
                from experiments.gpu.models import SHAPES

                res = paired_child(args.model, args.shape, SHAPES[args.shape]["num_hidden_layers"], spec["reps"],
                                   spec["layers"], spec["split"], spec.get("aux_only", False), spec.get("aa", False),
                                   spec.get("pin") or "", tuple(spec.get("variants", ())),
                                   tuple(spec.get("batches") or BATCHES), spec.get("capture_first", False))
            else:
                res = child(spec, args.model, args.shape, args.tp)
        except Exception as exc:  # noqa: BLE001  (reported in the table, the other configs go on)
            import traceback

            res = {**spec, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
        (out / f"child-{spec['name']}.json").write_text(json.dumps(res))
        return

    sys.path.insert(0, str(REPO))
    from experiments.gpu.models import SHAPES, build_model
    from uhead_vllm.generation.host_memory import huge_pages_setting

    import torch
    import vllm

    out.mkdir(parents=True, exist_ok=True)
    model = build_model(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{args.shape}", args.shape,
                        Path(args.tokenizer), save_weights=False)
    commit = provenance.commit()  # on the GPU machine: UHEAD_COMMIT, named by the caller
    meta = {"gpu": torch.cuda.get_device_name(0), "vllm": vllm.__version__, "torch": torch.__version__,
            "commit": commit, "command": " ".join(["python -m experiments.gpu.bench_gpu", *sys.argv[1:]]),
            "tensor_parallel_size": args.tp, "gpus": torch.cuda.device_count(),
            "transparent_huge_pages": huge_pages_setting(),
            "workload": {"batches_prompts": list(args.batches) if args.paired else list(BATCHES), "n": N,
                         "max_tokens": MAX_TOKENS, "reps": REPS, "dtype": "bfloat16", "capture_dtype": "bfloat16"}}
    results = []
    only = set(filter(None, args.only.split(",")))
    specs = configs(args.shape, SHAPES[args.shape]["num_hidden_layers"])
    if args.paired:  # --rounds: each round a fresh process with fresh engines, the build order alternating
        specs = [dict(name="paired" if args.rounds == 1 else f"paired-r{k + 1}", runner="v2", reps=args.reps,
                      layers=args.layers, split=args.split, aux_only=args.aux_only, aa=args.aa, pin=args.pin,
                      variants=args.variant, batches=args.batches, capture_first=bool(k % 2))
                 for k in range(args.rounds)]
    for spec in specs:
        if only and spec["name"] not in only:
            continue
        env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1" if spec["runner"] == "v2" else "0"}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "experiments.gpu.bench_gpu", "--shape", args.shape,
                               "--tokenizer", args.tokenizer, "--out", str(out), "--model", str(model), "--tp", str(args.tp),
                               "--child", json.dumps(spec)], cwd=REPO, env=env, capture_output=True, text=True)
        path = out / f"child-{spec['name']}.json"
        res = json.loads(path.read_text()) if path.exists() else {**spec, "error": proc.stderr[-2000:]}
        path.unlink(missing_ok=True)
        res["wall_seconds"] = time.perf_counter() - t0
        results.append(res)
        if "error" in res:
            summary = "ERROR " + res["error"][-600:].replace("\n", " | ")
        elif args.paired:
            summary = {b: round(v["ratio_of_medians"], 3) for b, v in res["batches"].items()}
        else:
            summary = {b: round(v["tok_per_s"]) for b, v in res["batches"].items()}
        print(f"[bench] {spec['name']}: {time.perf_counter() - t0:.0f} s {summary}", flush=True)
        name = f"bench-{args.shape}" + (f"-tp{args.tp}" if args.tp > 1 else "") + ("-paired" if args.paired else "")
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        if args.paired and "error" not in res:  # a failed run keeps its spec's batch sizes, a list
            suffix = "" if args.rounds == 1 else f"-r{len(results)}"
            (out / f"{name}{suffix}.md").write_text(paired_report(res, args.shape, meta))
        if args.paired and args.rounds > 1:
            (out / f"{name}-rounds.md").write_text(rounds_report(results, args.shape, meta))
        elif not args.paired:
            (out / f"{name}.md").write_text(report(results, args.shape, meta))


if __name__ == "__main__":
    main()
