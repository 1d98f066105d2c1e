"""What fanning prompt rows out to a prefix group's members costs the placer thread, per call:
``python -m experiments.bench.fanout [--reps 7]``.

The paired GPU bench's SmolLM2 workload (64 chat prompts x n=4, 128 tokens each, block size 16):
its prompts share one 16-token block (the chat template) across all 256 requests and each
prompt's tokens across its 4 samples. The device writes every row into its own place; then the
placer copies each prompt row a member forwarded into the places of the members that did not
(``placer.share_written_rows``). Three first-prefill layouts, timed on the host (no engine):
``vLLM V1``, what the GPU runs showed (``rows_from_shared_prefix`` 10,480 a call): one step in
which vLLM's scheduler counts a full block as cached once an earlier request of the step was given
it, so each request forwards its prompt from its longest full-block prefix shared with an earlier
request (the whole prompt shared: all but its last partial block); ``whole prompts``, every
request forwards its whole prompt in one step (nothing cached), so every place is its own
request's; ``two steps``, 130 requests forward whole prompts, the rest after, served the shared
block from the cache.

Rows and marks are hashed so that runs at different commits can be compared bit for bit.
Writes ``experiments/results/bench/fanout.{json,md}`` stamped with the commit and command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import sys
import time

import numpy as np
import torch

from .env import REPO_ROOT
from .workload import rendered_prompts
from experiments import provenance

OUT = REPO_ROOT / "experiments" / "results" / "bench"
PROMPTS, SAMPLES, TOKENS, BLOCK = 64, 4, 128, 16
SHAPE = (3, 576)  # SmolLM2: three captured layers of 576


def workload() -> tuple[list[list[int]], object]:
    """The prompts' token ids and their destination (slots for prompt + TOKENS, prefix groups)."""
    from transformers import AutoTokenizer

    from uhead_vllm.capture.destination import RowDestination
    from uhead_vllm.generation.prefix_groups import groups_within_slots, prefix_groups
    from uhead_vllm.models import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in rendered_prompts(tokenizer, PROMPTS)]
    slots, first = {}, 0
    for i, prompt in enumerate(ids):
        for s in range(SAMPLES):
            slots[SAMPLES * i + s] = (first, len(prompt) + TOKENS)
            first += len(prompt) + TOKENS
    shared = prefix_groups([(b"", prompt, tuple(range(SAMPLES * i, SAMPLES * i + SAMPLES)))
                            for i, prompt in enumerate(ids)], BLOCK)
    dest = RowDestination(torch.zeros((first, *SHAPE), dtype=torch.bfloat16), slots, groups_within_slots(shared, slots))
    return ids, dest


def cached_at_allocation(ids: list[list[int]]) -> dict[int, int]:
    """Per request, the prompt tokens vLLM V1 serves from blocks an earlier request of the same
    step was given: its longest common prefix with an earlier request in whole blocks, at most
    the full blocks before its last token (the last token is always forwarded)."""
    cached, seen = {}, []
    for t in range(len(ids) * SAMPLES):
        prompt = ids[t // SAMPLES]
        common = max((len(os.path.commonprefix([prompt, other])) for other in seen), default=0)
        cached[t] = min(common, len(prompt) - 1) // BLOCK * BLOCK
        seen.append(prompt)
    return cached


def prefill(ids: list[list[int]], dest, requests: range, cached: int | dict[int, int]) -> tuple[torch.Tensor, object]:
    """One step's metadata and chunk slots: ``requests`` forward their prompts from ``cached`` on
    (one count for all, or per request)."""
    from uhead_vllm.capture.placer import ChunkSlots

    positions, tokens, chunks = [], [], []
    for t in requests:
        prompt = ids[t // SAMPLES]
        start = cached if isinstance(cached, int) else cached[t]
        positions += range(start, len(prompt))
        tokens += prompt[start:]
        chunks.append((dest.slots[t][0], dest.slots[t][1], len(prompt) - start, dest.group_row.get(t, -1)))
    return torch.tensor([positions, tokens]), ChunkSlots(*(np.asarray(c, dtype=np.int64) for c in zip(*chunks)))


def run(ids, dest, steps: list[tuple[torch.Tensor, object]], reps: int) -> dict:
    """Median ms of the fan-out of ``steps`` (own rows written first, as the device does)."""
    from uhead_vllm.capture.placer import own_places, share_written_rows

    times = []
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn((meta.shape[1], *SHAPE), generator=generator).to(torch.bfloat16) for meta, _ in steps]
    for _ in range(reps):
        dest.marks[:] = -1
        dest.byte_rows[:] = 0
        for (meta, chunks), hidden in zip(steps, rows):
            index, inside = own_places(chunks, meta[0].numpy())
            dest.byte_rows[index[inside]] = hidden.view(torch.uint8).numpy().reshape(len(index), -1)[inside]
            dest.marks[index[inside]] = meta[1].numpy()[inside]
        start = time.perf_counter()
        for meta, chunks in steps:
            share_written_rows(dest, meta, chunks)
        times.append(time.perf_counter() - start)
    digest = hashlib.sha256(dest.byte_rows.tobytes() + dest.marks.tobytes()).hexdigest()[:16]
    return {"ms": round(1e3 * statistics.median(times), 2), "all_ms": [round(1e3 * t, 2) for t in times],
            "rows": int(sum(meta.shape[1] for meta, _ in steps)), "shared_places": int((dest.marks < -1).sum()),
            "digest": digest}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    ids, dest = workload()
    n = PROMPTS * SAMPLES
    layouts = {"vLLM V1": [prefill(ids, dest, range(n), cached_at_allocation(ids))],
               "whole prompts": [prefill(ids, dest, range(n), 0)],
               "two steps": [prefill(ids, dest, range(130), 0), prefill(ids, dest, range(130, n), BLOCK)]}
    result = {"commit": provenance.commit(), "command": shlex.join(["python", "-m", "experiments.bench.fanout", *sys.argv[1:]]),
              "workload": f"{PROMPTS} prompts x n={SAMPLES}, block {BLOCK}, rows {SHAPE} bf16",
              "layouts": {name: run(ids, dest, steps, args.reps) for name, steps in layouts.items()}}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fanout.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Prompt-row fan-out per call ({result['workload']}, host only)", "",
             f"commit `{result['commit']}`, command `{result['command']}`; median of {args.reps} runs", "",
             "| first prefill | rows | shared places written | fan-out ms | rows + marks digest |", "|---|---:|---:|---:|---|"]
    for name, r in result["layouts"].items():
        lines.append(f"| {name} | {r['rows']} | {r['shared_places']} | {r['ms']} | `{r['digest']}` |")
    (OUT / "fanout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
