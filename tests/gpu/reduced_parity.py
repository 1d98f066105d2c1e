"""GPU run of rows reduced to a head's inputs inside the worker, one engine per process (run by
test_capture_gpu.py).

    python tests/gpu/reduced_parity.py --model DIR --mode graphs --out result.json

The engine is built with a token-inputs weight ``[D, L * H]`` (``D = 128``, an attention head's
``d_model``; random: the map, not a fit, is tested) for layers given out of order. Prompts sharing
a long prefix, n=4, strict mode: the window "all" cold, then cached (rows from the row store), then
"generated". Every sample's rows ``[rows, 1, D]`` are compared with the weight applied to HF's rows
on the GPU; the counters say only ``D`` float32 values per row crossed to the host.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.gpu.capture_parity import (PREFIX, QUESTIONS, case_main, engine_kwargs, hf_reference,  # noqa: E402
                                            relative_l2)

D = 128


def run(model_dir: str, mode: str, dtype: str, layers: tuple[int, ...]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from uhead_vllm.capture.token_weight import save_weight
    from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    width = len(layers) * hf.config.hidden_size
    weight = torch.randn(D, width, generator=torch.Generator().manual_seed(0)) / width ** 0.5
    path = os.path.join(tempfile.mkdtemp(), "token_inputs.safetensors")
    save_weight(path, layers, weight)
    llm = build_llm(model_dir, layers, dtype=dtype, capture_dtype="float32", token_inputs=path, **engine_kwargs(mode))
    gen = VllmHiddenStatesGenerator(llm, strict=True)
    w = weight.cuda()
    prompts = [PREFIX + q + "\n" for q in QUESTIONS[:8]]
    sp = SamplingParams(n=4, max_tokens=24, temperature=0.8, seed=1)
    errs, phases, problems = [], {}, []
    if gen.hidden_size != D or gen.columns != 1:
        problems.append(f"the generator sizes rows [{gen.columns}, {gen.hidden_size}], not [1, {D}]")

    def phase(name: str, window: Any) -> None:
        res = gen.generate(prompts, sp, window=window)
        st = res.stats
        for per in res.hidden_states:
            for s in per:
                first = 0 if window == "all" else s.prompt_len
                if s.hidden.shape != (len(s.token_ids) - 1 - first, 1, D) or not s.reduced:
                    problems.append(f"{name}: rows {tuple(s.hidden.shape)} are not [rows, 1, {D}]")
                    continue
                ref = hf_reference(hf, s.token_ids, layers)[first: first + s.hidden.shape[0]].flatten(1) @ w.T
                errs.append(relative_l2(s.hidden.cuda(), ref[:, None]).cpu())
        if st.bytes_to_host != (st.tokens_forwarded - st.rows_skipped) * D * 4:
            problems.append(f"{name}: bytes_to_host {st.bytes_to_host} is not D float32 values per row recorded")
        phases[name] = vars(st)

    gen.reset_hs_step_cache(reset_prefix_cache=True)
    phase("all_cold", "all")
    phase("all_cached", "all")
    phase("generated", "generated")
    err = torch.cat(errs)
    return {"rows_checked": int(err.shape[0]), "max_rel_l2": float(err.max()), "phases": phases, "problems": problems}


if __name__ == "__main__":
    case_main(run, "22,8,30", __doc__.splitlines()[0])
