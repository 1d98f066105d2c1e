"""Throughput and latency of `uhead-vllm serve` with uncertainty on vs off, side by side.

One server (embedded model, shipped head, default serve settings); at each concurrency the two
modes alternate in rounds, so both see the same machine state. A request is one arithmetic
question in the head's prompt, greedy, max_tokens from the head's recipe (64).

    python -m experiments.serving.bench                  # concurrency 1, 8, 32; ≈10 min on 2 cores
    python -m experiments.serving.bench --quick          # tiny numbers, to check it runs

Writes experiments/results/serving/bench.{json,md}, stamped with the commit and the command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from experiments import provenance  # noqa: E402
from serving_server import Server  # noqa: E402


def questions(n: int) -> list[str]:
    return [f"What is {11 + 7 * i % 83} + {5 + 13 * i % 71}?" for i in range(n)]


def run_round(client, model: str, template: str, qs: list[str], concurrency: int, uncertainty: bool,
              max_tokens: int) -> dict:
    extra = {"uncertainty": True} if uncertainty else {}

    def one(q: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": template.replace("{question}", q)}],
                                           max_tokens=max_tokens, temperature=0, extra_body=extra)
        if uncertainty:
            assert r.choices[0].model_extra["uncertainty"]["steps"]
        return time.perf_counter() - t0, r.usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, qs))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "latencies": [o[0] for o in out], "tokens": sum(o[1] for o in out)}


def summarise(rounds: list[dict]) -> dict:
    lat = sorted(x for r in rounds for x in r["latencies"])
    wall = sum(r["wall_s"] for r in rounds)
    n = len(lat)
    return {"requests": n, "req_per_s": n / wall, "tok_per_s": sum(r["tokens"] for r in rounds) / wall,
            "p50_s": statistics.median(lat), "p95_s": lat[min(n - 1, int(round(0.95 * (n - 1))))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=32, help="requests per mode and concurrency per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "serving"))
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.requests, args.rounds = [1, 4], 4, 1
    from openai import OpenAI

    commit = provenance.commit()
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = Server(["--max-num-seqs", "32"], log, timeout=600)
    try:
        info = server.get_json("/uhead/info")
        client = OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        template, max_tokens = info["prompt_template"], info["max_tokens"]
        run_round(client, model, template, questions(4), 4, True, max_tokens)  # warm-up (kernels, caches)
        results = {}
        for c in args.concurrency:
            rounds = {"off": [], "on": []}
            for r in range(args.rounds):
                qs = questions(args.requests)
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    rounds[mode].append(run_round(client, model, template, qs, c, mode == "on", max_tokens))
            results[c] = {m: summarise(v) for m, v in rounds.items()}
            off, on = results[c]["off"], results[c]["on"]
            results[c]["throughput_cost"] = 1 - on["req_per_s"] / off["req_per_s"]
            print(f"concurrency {c}: off {off['req_per_s']:.2f} req/s, on {on['req_per_s']:.2f} req/s "
                  f"({100 * results[c]['throughput_cost']:+.1f}% cost)", flush=True)
        status = server.get_json("/uhead/status")
    finally:
        server.stop()
    meta = {"commit": commit, "command": " ".join(["python", "-m", "experiments.serving.bench", *sys.argv[1:]]),
            "requests_per_round": args.requests, "rounds": args.rounds, "max_tokens": max_tokens,
            "server_status_after": status, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "bench-quick" if args.quick else "bench"
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    lines = ["# uhead-vllm serve: uncertainty on vs off", "",
             f"commit `{meta['commit']}`, `{meta['command']}`, {meta['time']}; embedded SmolLM2-135M-Instruct, "
             f"shipped head, greedy, max_tokens {max_tokens}, {args.rounds} interleaved rounds x {args.requests} "
             "requests per mode and concurrency, one server, 2-core CPU.", "",
             "| concurrency | req/s off | req/s on | cost | p50 off / on (s) | p95 off / on (s) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for c, r in results.items():
        off, on = r["off"], r["on"]
        lines.append(f"| {c} | {off['req_per_s']:.2f} | {on['req_per_s']:.2f} | {100 * r['throughput_cost']:+.1f}% | "
                     f"{off['p50_s']:.2f} / {on['p50_s']:.2f} | {off['p95_s']:.2f} / {on['p95_s']:.2f} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
