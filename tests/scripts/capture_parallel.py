"""Capture with a tensor-parallel engine; save rows for the test.

Usage: python capture_parallel.py MODEL OUT.safetensors LAYERS_JSON tp
TP=2 (workers bound to one core each), generate through VllmHiddenStatesGenerator and save every
sample's token ids and hidden rows plus each rank's capture status. Only safetensors cross the
process boundary (statuses travel as JSON metadata).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")


def main() -> None:
    import torch
    from safetensors.torch import save_file
    from vllm import SamplingParams

    from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm

    model, out, layers, mode = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    common = dict(enforce_eager=True, block_size=32, kv_cache_memory_bytes=32 << 20, max_model_len=256,
                  max_num_seqs=4, max_num_batched_tokens=64, seed=0, enable_prefix_caching=True)
    if mode != "tp":
        raise SystemExit(f"unknown mode {mode!r}")
    llm = build_llm(model, layers, tensor_parallel_size=2, **common)
    statuses = [json.loads(s) for s in llm.collective_rpc("uhead_status")]
    gen = VllmHiddenStatesGenerator(llm)
    prompts = ["12 + 7 = 19 and the cat sat on the mat. " * 4, "3 * 4 = 12"]
    res = gen.generate(prompts, SamplingParams(max_tokens=8, temperature=0.8, n=2))
    again = gen.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # prefix-cache hit
    tensors = {}
    for name, r in (("first", res), ("again", again)):
        for i, per in enumerate(r.hidden_states):
            for s in per:
                tensors[f"{name}_{i}_{s.sample_index}_ids"] = torch.tensor(s.token_ids)
                tensors[f"{name}_{i}_{s.sample_index}_hidden"] = s.hidden.contiguous()
    meta = {"statuses": json.dumps([{"recording": s["recording"], "route": s.get("route")} for s in statuses]),
            "again_stats": json.dumps(vars(again.stats))}
    save_file(tensors, out, metadata=meta)


if __name__ == "__main__":
    main()
