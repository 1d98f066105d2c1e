"""Host time the server spends on one finished choice, on its event loop: assembling the
sequence's rows (``UncertaintyService.sequence_rows``' part: place the captured rows, look up the
row store) and scoring them (``Scorer.score``: split steps, features, head). At concurrency c
these add up once per choice on one thread, so they bound scored throughput at high c.

    python -m experiments.serving.choice_cost --out experiments/results/serving/choice-cost.json

Uses SmolLM2-135M's tokenizer (``~/.cache/uhead_vllm/models``) and a linear head on two layers;
rows are random at ``--hidden`` width (4096: the 8B shape), answers random token ids with
top-``k`` logprobs as vLLM returns them; one torch thread, as the server sets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for p in (REPO / "tests", REPO):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def _head(model: Path, out: Path, layers: list[int], hidden: int):
    """The tests' tiny linear head (serving_server.build_tiny_head) at ``hidden`` width."""
    import shutil

    from serving_server import build_tiny_head
    from uhead_vllm.heads import load_head

    shaped = out.parent / "model"
    shaped.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, shaped / f.name)
    config = json.loads((model / "config.json").read_text())
    (shaped / "config.json").write_text(json.dumps({**config, "hidden_size": hidden}))
    return load_head(build_tiny_head(shaped, out, layers))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer
    from vllm.logprobs import Logprob

    from experiments import provenance
    from uhead_vllm.generation.completion import RowCompletion, SequenceRows
    from uhead_vllm.models import embedded_model_path
    from uhead_vllm.serving.record import new_tag
    from uhead_vllm.serving.scoring import Scorer

    torch.set_num_threads(1)
    model = embedded_model_path()
    layers = [15, 30]
    work = Path(args.out).with_suffix("")
    head = _head(model, work / "head", layers, args.hidden)
    tokenizer = AutoTokenizer.from_pretrained(model)
    scorer = Scorer(head, "head", tokenizer, layers)
    rng = random.Random(0)

    async def no_recompute(requests: list) -> None:
        raise AssertionError("every row was captured")

    cells = []
    for prompt_len in args.prompt_tokens:
        for n_tokens in args.tokens:
            completion = RowCompletion(16, 256 << 20, new_tag)
            rows_ms, score_ms = [], []
            for _ in range(args.repeats):
                ids = [rng.randrange(tokenizer.vocab_size) for _ in range(n_tokens)]
                logprobs = [{t: Logprob(-0.5, 1, None), **{rng.randrange(tokenizer.vocab_size): Logprob(-1.0 - k, k + 2, None)
                                                          for k in range(3)}} for t in ids]
                expected = torch.tensor([rng.randrange(tokenizer.vocab_size) for _ in range(prompt_len)] + ids)
                num_rows = prompt_len + n_tokens - 1
                positions = torch.arange(prompt_len, num_rows)  # the generated window, as the server captures
                captured = (positions, expected[positions], torch.randn(len(positions), 2, args.hidden).to(torch.bfloat16))
                t0 = time.perf_counter()
                seq = SequenceRows.captured(expected, num_rows, captured, 2, args.hidden, torch.bfloat16, salt="s",
                                            cache_salt="s", steer_args={}, need_from=prompt_len)
                asyncio.run(completion.complete_async([seq], no_recompute))
                t1 = time.perf_counter()
                scored = scorer.score(ids, logprobs, tokenizer.decode(ids), "length", seq.rows[prompt_len:])
                t2 = time.perf_counter()
                assert scored["answer_p_wrong"] is not None, "the head did not score: a shape mismatch?"
                rows_ms.append(1000 * (t1 - t0))
                score_ms.append(1000 * (t2 - t1))
            cell = {"prompt_tokens": prompt_len, "tokens": n_tokens, "rows_ms_median": statistics.median(rows_ms),
                    "score_ms_median": statistics.median(score_ms)}
            print(cell, flush=True)
            cells.append(cell)
    result = {"meta": {"commit": provenance.commit(), "command": "python -m experiments.serving.choice_cost "
                       + " ".join(argv if argv is not None else sys.argv[1:]), "hidden": args.hidden,
                       "repeats": args.repeats, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "torch": torch.__version__},
              "cells": cells}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
