"""GPU run of capture windows and shared prompt rows, one engine per process (run by test_capture_gpu.py).

    python tests/gpu/window_parity.py --model DIR --mode graphs --out result.json

Prompts sharing a long prefix, n=4, on one engine with prefix caching, strict mode: the window
"all", then "generated" and 24 prompt rows with the prompts cached, a step continuing a shared
sample, and "generated" again from a cold cache. Rows inside each window are compared with HF's on the GPU; the
counters say what crossed to the host (the rows held, never those outside a window) and the
samples' prompt parts are one copy per prompt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.gpu.capture_parity import (PREFIX, QUESTIONS, case_main, engine_kwargs, hf_reference,  # noqa: E402
                                            relative_l2)


def run(model_dir: str, mode: str, dtype: str, layers: tuple[int, ...]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm

    llm = build_llm(model_dir, layers, dtype=dtype, capture_dtype=dtype, **engine_kwargs(mode))
    gen = VllmHiddenStatesGenerator(llm, strict=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    row_bytes = len(layers) * gen.hidden_size * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    prompts = [PREFIX + q + "\n" for q in QUESTIONS[:8]]
    sp = SamplingParams(n=4, max_tokens=24, temperature=0.8, seed=1)
    errs, phases, problems = [], {}, []

    def phase(name: str, window: Any, texts: list[str], params: Any = sp) -> Any:
        res = gen.generate(texts, params, window=window)
        st = res.stats
        held = 0
        for per in res.hidden_states:
            for s in per:
                p = s.prompt_len
                first = {"all": 0, "generated": p}.get(window, max(p - window, 0) if isinstance(window, int) else 0)
                if s.first_row != first or s.generated_rows().data_ptr() != s.own_rows.data_ptr():
                    problems.append(f"{name}: first_row {s.first_row} != {first} or generated rows copied")
                if s.prompt_rows.data_ptr() != per[0].prompt_rows.data_ptr():
                    problems.append(f"{name}: sample {s.sample_index}'s prompt rows are not sample 0's")
                held += s.own_rows.shape[0] + (s.prompt_rows.shape[0] if s.sample_index == 0 else 0)
                ref = hf_reference(hf, s.token_ids, layers)[first : first + s.hidden.shape[0]]
                errs.append(relative_l2(s.hidden.cuda(), ref).cpu())
        if st.bytes_to_host != (st.tokens_forwarded - st.rows_skipped) * row_bytes:
            problems.append(f"{name}: bytes_to_host {st.bytes_to_host} is not the rows recorded")
        phases[name] = {**vars(st), "rows_held": held}
        return res

    gen.reset_hs_step_cache(reset_prefix_cache=True)
    full = phase("all", "all", prompts)
    hit = phase("generated_cached", "generated", prompts)
    if (hit.stats.rows_from_store, hit.stats.rows_recomputed) != (0, 0):
        problems.append("generated_cached: a prefix-cache hit below the window cost a fill or a recompute")
    phase("k24_cached", 24, prompts)  # past a 16-token block: some rows from the store
    s = full.hidden_states[0][3]  # its block across the prompt's end: joined from sample 0's rows in the store
    phase("continue_shared_sample", "all", [s.prompt + s.text], SamplingParams(max_tokens=12, temperature=0.0))
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    cold = phase("generated_cold", "generated", prompts)
    if cold.stats.rows_captured != phases["generated_cold"]["rows_held"]:
        problems.append("generated_cold: the worker recorded rows outside the windows")
    err = torch.cat(errs)
    return {"rows_checked": int(err.shape[0]), "max_rel_l2_per_layer": dict(zip(map(str, layers), err.amax(0).tolist())),
            "phases": phases, "problems": problems}


if __name__ == "__main__":
    case_main(run, "0,15,30", __doc__.splitlines()[0])
