"""What splitting a growing answer into steps costs: ``python -m experiments.bench.step_split``.

A server scoring steps while a request runs splits the answer again at each possible step end
(features.split_steps: every token's character offsets, then the cuts). Offsets used to come from
decoding every prefix of the answer (all prefixes in one call into a fast tokenizer's backend),
quadratic in its length; now each token is read off a short window, all windows decoded in one
call. Timed side by side on the same answers: every prefix decoded one by one (a plain ``decode``
function, what a decoder without a fast backend still uses), every prefix in one backend call (the
previous way, offsets only) and the windows; all must give the same offsets and steps. And the
server's case: an answer split again at every step end as it grows, afresh each time or with its
offsets kept between splits. Writes
``experiments/results/bench/step_split.{json,md}`` stamped with commit, command and hardware.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from experiments import provenance

from .env import REPO_ROOT

OUT = REPO_ROOT / "experiments" / "results" / "bench"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None,
                    help="a fast tokenizer's folder (default: the embedded SmolLM2 model's, from scripts/setup.sh)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from uhead_vllm.features import AnswerOffsets, _common_prefix_len, split_steps, token_char_ends

    if args.tokenizer is None:
        from uhead_vllm.models import embedded_model_path

        args.tokenizer = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    text = "".join(f"Step {i}: 12 * {i} = {12 * i}, so we carry {i % 7} and move on to the next one.\n"
                   for i in range(1000))
    ids = tok(text, add_special_tokens=False)["input_ids"]

    def per_prefix(t: list[int]) -> str:  # a plain decode function: no fast backend to batch
        return tok.decode(t, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def all_prefixes_at_once(t: list[int]) -> list[int]:  # the previous fast path: every prefix, one backend call
        full = per_prefix(t)
        texts = tok.backend_tokenizer.decode_batch([t[:k] for k in range(1, len(t) + 1)], skip_special_tokens=True)
        ends = list(itertools.accumulate((_common_prefix_len(x, full) for x in texts), max))
        ends[-1] = len(full)
        return ends

    def timed(f, *a) -> tuple[float, object]:
        runs, out = [], None
        for _ in range(args.reps):
            t0 = time.perf_counter()
            out = f(*a)
            runs.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(runs), out

    def growing(t: list[int], kept: bool) -> int:
        """Split at every step end as the answer grows (what a server scoring a running request
        does), with offsets kept between splits or each split afresh; returns the splits made."""
        offsets = AnswerOffsets(tok)
        ends = [k + 1 for k, piece in enumerate(tok.batch_decode([[i] for i in t])) if "\n" in piece]
        for end in ends:
            split_steps(t[:end], offsets if kept else tok)
        return len(ends)

    cells = []
    for n in args.tokens:
        new_ms, new = timed(split_steps, ids[:n], tok)
        old_ms, old = timed(split_steps, ids[:n], per_prefix)
        batch_ms, batch_ends = timed(all_prefixes_at_once, ids[:n])
        assert new == old, f"the two ways split {n} tokens differently"
        assert batch_ends == token_char_ends(ids[:n], tok)[1], f"offsets of {n} tokens differ"
        fresh_ms, splits = timed(growing, ids[:n], False)
        kept_ms, _ = timed(growing, ids[:n], True)
        cells.append({"tokens": n, "steps": len(new), "per_prefix_ms": round(old_ms, 1),
                      "all_prefixes_one_call_ms": round(batch_ms, 1), "windows_ms": round(new_ms, 1),
                      "growing_splits": splits, "growing_fresh_ms": round(fresh_ms, 1), "growing_kept_ms": round(kept_ms, 1)})
        print(cells[-1], flush=True)
    result = {**provenance.stamp("experiments.bench.step_split", argv), "tokenizer": type(tok).__name__,
              "vocab": len(tok), "reps": args.reps, "cells": cells}
    lines = ["# Splitting an answer into steps: every prefix decoded vs each token read off a window", "",
             f"commit `{result['commit']}`, command `{result['command']}`, {result['hardware']}, a "
             f"{result['vocab']}-token vocabulary ({result['tokenizer']}); medians of {args.reps} runs; both ways give "
             "the same steps (offsets only for the one-call way, which splits nothing)", "",
             "| answer tokens | steps | every prefix, one decode each (ms) | every prefix, one backend call (ms, "
             "offsets only) | windows, split included (ms) |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {c['tokens']} | {c['steps']} | {c['per_prefix_ms']} | {c['all_prefixes_one_call_ms']} | "
              f"{c['windows_ms']} |" for c in cells]
    lines += ["", "A growing answer split at every step end (a server scoring a running request), windows each time "
              "afresh vs offsets kept between splits (`features.AnswerOffsets`), all splits together:", "",
              "| answer tokens | splits | afresh (ms) | kept (ms) |", "|---:|---:|---:|---:|"]
    lines += [f"| {c['tokens']} | {c['growing_splits']} | {c['growing_fresh_ms']} | {c['growing_kept_ms']} |"
              for c in cells]
    provenance.write(OUT, "step_split", result, lines)
    return result


if __name__ == "__main__":
    main()
