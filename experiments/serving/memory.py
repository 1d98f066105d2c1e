"""Server memory over time: does `uhead-vllm serve` hold on to anything between requests?

One server (embedded model, shipped head). Each round sends scored requests that also ask for the
captured rows of three layers (the largest per-request state), n=2, plus streaming requests whose
client leaves mid-stream; after every round it samples the resident memory of the server's process
tree (API server + engine core) and what the server says it holds (`GET /uhead/status`). Bounded
memory means flat RSS after warm-up and zero rows held between rounds. At the end it runs the
README's Python client example and keeps what it prints.

    python -m experiments.serving.memory               # 12 rounds; ≈6 min on 2 cores
    python -m experiments.serving.memory --rounds 2    # to check it runs

Writes experiments/results/serving/memory.{json,md}, stamped with the commit and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from experiments import provenance  # noqa: E402
from experiments.serving.bench import questions  # noqa: E402
from serving_server import Server  # noqa: E402

ROW_LAYERS = [14, 18, 22]  # the shipped head's layers, which the server captures by default


def tree_rss_mb(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20


def scored_with_rows(server: Server, model: str, template: str, q: str, max_tokens: int) -> None:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": template.replace("{question}", q)}],
            "max_tokens": max_tokens, "temperature": 0.8, "n": 2, "seed": 1,
            "uncertainty": {"steps": True, "rows": {"layers": ROW_LAYERS}}}
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
    for choice in r.json()["choices"]:
        assert choice["uncertainty"]["steps"] and choice["uncertainty"]["rows"]


def left_mid_stream(server: Server, model: str, template: str, q: str) -> None:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": template.replace("{question}", q)}],
            "max_tokens": 200, "ignore_eos": True, "stream": True, "n": 2,
            "uncertainty": {"steps": True, "rows": {"layers": ROW_LAYERS}}}
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=600) as r:
        for k, _ in enumerate(r.iter_lines()):
            if k > 8:
                break


def readme_example(url: str) -> str:
    """The README's Python client example, verbatim, with what it prints."""
    from uhead_vllm.client import UncertaintyClient

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        client = UncertaintyClient(url)
        [a] = client.chat("What is 45 + 38?")
        print(a.answer_p_wrong, [(s.text, s.p_wrong) for s in a.steps])
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--requests", type=int, default=16, help="scored requests with rows per round")
    ap.add_argument("--row-store-bytes", type=int, default=16 << 20,
                    help="the server's row store budget (small, so that it fills within the run)")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "serving"))
    args = ap.parse_args()
    from openai import OpenAI

    commit = provenance.commit()
    server = Server(["--max-num-seqs", "32", "--row-store-bytes", str(args.row_store_bytes)], Path(tempfile.mkdtemp()) / "server.log", timeout=600)
    samples = []
    try:
        info = server.get_json("/uhead/info")
        model = OpenAI(base_url=server.url, api_key="none").models.list().data[0].id
        template, max_tokens = info["prompt_template"], info["max_tokens"]
        samples.append({"round": 0, "rss_mb": tree_rss_mb(server.proc.pid), **server.get_json("/uhead/status")})
        for r in range(1, args.rounds + 1):
            qs = questions(args.requests * r)[-args.requests:]  # new questions every round
            with ThreadPoolExecutor(8) as pool:
                jobs = [pool.submit(scored_with_rows, server, model, template, q, max_tokens) for q in qs]
                jobs += [pool.submit(left_mid_stream, server, model, template, q) for q in qs[:4]]
                for j in jobs:
                    j.result()
            OpenAI(base_url=server.url, api_key="none").chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)  # step past aborts
            time.sleep(1.0)
            status = server.get_json("/uhead/status")
            samples.append({"round": r, "rss_mb": tree_rss_mb(server.proc.pid), **status})
            print(f"round {r}: rss {samples[-1]['rss_mb']:.0f} MiB, worker_bytes_held "
                  f"{status['worker_bytes_held']}, server_bytes_held {status['server_bytes_held']}", flush=True)
        example = readme_example(server.url)
    finally:
        server.stop()
    meta = {"commit": commit,
            "command": " ".join(["python", "-m", "experiments.serving.memory", *sys.argv[1:]]),
            "rounds": args.rounds, "requests_per_round": args.requests, "row_layers": ROW_LAYERS,
            "row_store_bytes": args.row_store_bytes,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps({"meta": meta, "samples": samples, "readme_example": example}, indent=2) + "\n")
    rss = [s["rss_mb"] for s in samples]
    warm = rss[min(2, len(rss) - 1):]
    lines = ["# uhead-vllm serve: memory over time", "",
             f"commit `{meta['commit']}`, `{meta['command']}`, {meta['time']}; embedded SmolLM2-135M-Instruct, "
             f"shipped head; per round {args.requests} scored requests (n=2, rows of layers {ROW_LAYERS}) and 4 "
             "streaming requests left mid-stream, 8 at a time; resident memory of the server's process tree "
             f"after each round; row store budget {args.row_store_bytes} bytes (it fills up to that, by design).", "",
             "| round | RSS (MiB) | rows held by the worker (bytes) | rows held by the server (bytes) | row store (bytes) |",
             "|---:|---:|---:|---:|---:|"]
    for s in samples:
        lines.append(f"| {s['round']} | {s['rss_mb']:.0f} | {s['worker_bytes_held']} | {s['server_bytes_held']} | "
                     f"{s.get('store_bytes', '-')} |")
    lines += ["", f"After warm-up (round {min(2, len(rss) - 1)} on) RSS ranges {min(warm):.0f}-{max(warm):.0f} MiB "
              f"(first {rss[0]:.0f} MiB, last {rss[-1]:.0f} MiB).", "",
              "The README's Python client example printed:", "", "```", example.strip(), "```"]
    (out / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
