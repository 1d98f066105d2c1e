"""GPU parity run: every row the generator returns equals Hugging Face's forward on the same ids.

One engine per process (the runner is chosen by ``VLLM_USE_V2_MODEL_RUNNER``, which vLLM reads
once). Four phases on one engine, prefix caching on, strict mode (a missed forward is an error):
  A. prompts sharing a long prefix, n=4 sampled answers;
  B. the same prompts again, n=2 (their prefix blocks now come from vLLM's prefix cache);
  C. online best-of-n: 3 steps, 3 candidates per question per step, the first continues;
  D. 72 tokens at a steady batch, so the recorder's step copies replay as CUDA graphs.
Every returned sample is compared with HF on the GPU: relative L2 error per row and layer; the last
index is the stream before the final norm, taken with a pre-hook on ``model.norm``.

    python -m experiments.gpu.capture_parity --model DIR --mode graphs --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

PREFIX = ("You are a careful assistant. Solve the problem step by step, write each step on its own "
          "line, check the arithmetic, and finish with 'The answer is N.' ") * 3
QUESTIONS = [f"What is {a} + {b}?" for a, b in [(7, 8), (45, 38), (12, 19), (93, 7), (66, 71), (5, 5),
                                               (31, 44), (18, 27), (250, 125), (9, 99), (14, 41), (72, 28)]]


def engine_kwargs(mode: str, tp: int = 1) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        enforce_eager=mode == "eager", enable_prefix_caching=True, max_model_len=1024,
        gpu_memory_utilization=0.12, kv_cache_memory_bytes=2 << 30, max_num_seqs=64, seed=0,
        tensor_parallel_size=tp,
    )
    if mode == "graphs":
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 48, 64]}
    return kwargs


@torch.no_grad()
def hf_reference(model: Any, token_ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """``[T, L, H]`` float32 reference; the last index read before the final norm."""
    seen: dict[str, torch.Tensor] = {}
    handle = model.model.norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("pre_norm", a[0]))
    try:
        out = model(torch.tensor([token_ids], device="cuda"), output_hidden_states=True)
    finally:
        handle.remove()
    n_layers = model.config.num_hidden_layers
    rows = [seen["pre_norm"][0] if k == n_layers else out.hidden_states[k][0] for k in layers]
    return torch.stack(rows, dim=1).float()


def relative_l2(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``[T, L]`` ‖got − ref‖ / ‖ref‖ per row and layer."""
    got, ref = got.float(), ref.float()
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)


def run(model_dir: str, mode: str, backend: str, dtype: str, layers: tuple[int, ...], tp: int = 1) -> dict[str, Any]:
    from vllm import SamplingParams

    from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm

    t0 = time.perf_counter()
    extra = {"capture_dir": os.path.join(os.environ.get("TMPDIR", "/tmp"), f"extract-{os.getpid()}")} \
        if backend == "extract" else {}
    llm = build_llm(model_dir, layers, dtype=dtype, capture_dtype=dtype, backend=backend,
                    **extra, **engine_kwargs(mode, tp))
    load_s = time.perf_counter() - t0
    gen = VllmHiddenStatesGenerator(llm, strict=True)
    samples, phases = [], {}

    def phase(name: str, prompts: list[str], sp: Any) -> list[str]:
        t = time.perf_counter()
        res = gen.generate(prompts, sp)
        phases[name] = {"seconds": time.perf_counter() - t, **vars(res.stats)}
        samples.extend(s for per_prompt in res.hidden_states for s in per_prompt)
        return [per_prompt[0].text for per_prompt in res.hidden_states]

    prompts = [PREFIX + q + "\n" for q in QUESTIONS]
    phase("A_n4", prompts, SamplingParams(n=4, max_tokens=24, temperature=0.8, seed=1))
    phase("B_repeat_n2", prompts, SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=2))
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    texts = [PREFIX + q + "\n" for q in QUESTIONS[:6]]
    for step in range(3):
        chosen = phase(f"C_best_of_3_step{step}", texts,
                       SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=10 + step))
        texts = [t + c for t, c in zip(texts, chosen)]
    # Long enough for the batch buffers to come round twice at a steady batch (16 steps a flush):
    # the recorder's step copies then replay as CUDA graphs (forwards_replayed), checked like the rest.
    phase("D_long", prompts[:4], SamplingParams(n=2, max_tokens=72, temperature=0.8, seed=3, ignore_eos=True))

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    errs = []
    for s in samples:
        ref = hf_reference(hf, s.token_ids, layers)[: s.hidden.shape[0]]
        errs.append(relative_l2(s.hidden.cuda(), ref).cpu())
    err = torch.cat(errs)  # [rows, L]
    return {
        "rows_checked": int(err.shape[0]), "sequences_checked": len(samples),
        "max_rel_l2_per_layer": dict(zip(map(str, layers), err.amax(0).tolist())),
        "p99_rel_l2_per_layer": dict(zip(map(str, layers), err.quantile(0.99, dim=0).tolist())),
        "median_rel_l2": float(err.median()),
        "phases": phases, "load_seconds": load_s,
        "totals": {k: sum(p[k] for p in phases.values())
                   for k in ("capture_missed_rows", "rows_recomputed", "prefix_cache_rows", "rows_from_store",
                             "rows_from_shared_prefix", "rows_captured", "forwards_seen", "forwards_recorded",
                             "forwards_replayed", "rows_placed", "rows_written_on_device")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["graphs", "eager"], required=True)
    ap.add_argument("--backend", choices=["aux", "extract"], default="aux")
    ap.add_argument("--dtype", default="float32", help="model dtype; falls back to bfloat16 if refused")
    ap.add_argument("--layers", default="0,15,30")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    layers = tuple(int(k) for k in args.layers.split(","))
    import vllm

    result: dict[str, Any] = {"mode": args.mode, "backend": args.backend, "layers": list(layers), "tp": args.tp,
                              "runner": "v1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "v2",
                              "vllm": vllm.__version__, "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name(0), "commit": os.environ.get("UHEAD_COMMIT", "")}
    for dtype in dict.fromkeys([args.dtype, "bfloat16"]):
        try:
            result.update(dtype=dtype, **run(args.model, args.mode, args.backend, dtype, layers, args.tp))
            result.pop("error", None)
            break
        except Exception as exc:  # noqa: BLE001  (recorded: fp32 may be refused by GPU attention)
            result.setdefault("refused", {})[dtype] = f"{type(exc).__name__}: {exc}"
            result["error"] = traceback.format_exc()[-3000:]
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "error"}, indent=1))


if __name__ == "__main__":
    main()


def case_main(run_case: Callable[[str, str, str, tuple[int, ...]], dict[str, Any]], default_layers: str,
              description: str) -> None:
    """The command line of a one-case parity script (tests/gpu/*_parity.py): ``--model``, ``--mode``,
    ``--layers``, ``--out``; fp32, else bf16 where fp32 is refused; any failure written as ``error``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["graphs", "eager"], required=True)
    ap.add_argument("--layers", default=default_layers)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    layers = tuple(int(k) for k in args.layers.split(","))
    result: dict[str, Any] = {"mode": args.mode, "layers": list(layers),
                              "runner": "v1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "v2"}
    for dtype in ("float32", "bfloat16"):
        try:
            result.update(dtype=dtype, **run_case(args.model, args.mode, dtype, layers))
            result.pop("error", None)
            break
        except Exception:  # noqa: BLE001  (reported to the test; bf16 where fp32 is refused)
            result["error"] = traceback.format_exc()[-4000:]
    Path(args.out).write_text(json.dumps(result, indent=1))
