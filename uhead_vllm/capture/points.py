"""Capture and steering points inside a decoder layer, named once for the worker and the engine.

Every point is defined against Hugging Face's decoder-layer modules (Llama / Qwen3 style), so a
forward hook on the HF module reads the same tensor as we capture inside vLLM:

==============  ======================================================  ==========================
point           Hugging Face meaning (decoder layer ``l``)              TransformerLens analogue
==============  ======================================================  ==========================
``attn_in``     input of ``self_attn`` = output of ``input_layernorm``  ``blocks.l.ln1.hook_normalized``
``attn_out``    output of ``self_attn`` (after ``o_proj``)              ``blocks.l.hook_attn_out``
``mlp_in``      input of ``mlp`` = output of ``post_attention_layernorm``  ``blocks.l.ln2.hook_normalized``
``mlp_out``     output of ``mlp`` (after ``down_proj``)                 ``blocks.l.hook_mlp_out``
``resid_post``  output of the layer = ``hidden_states[l + 1]``          ``blocks.l.hook_resid_post``
==============  ======================================================  ==========================

``attn_in`` / ``mlp_in`` are the normalised module inputs, not TransformerLens' pre-norm
``hook_attn_in`` / ``hook_mlp_in``. ``pre_attn`` and ``post_attn`` are accepted as aliases of
``attn_in`` and ``attn_out``. The residual stream is captured through ``layers`` (HF
``output_hidden_states`` indices, ``resid_post`` of layer l = index l + 1), so ``resid_post`` is a
steering point only.

Column order of captured rows: the ``layers`` columns first, in the order given, then one column
per ``(point, layer)`` site in the order given. The engine side treats a site as one more
"layer" column, so the row transfer, the prefix row store and the step cache need no change.
"""

from __future__ import annotations

from typing import Iterable

#: Points read or changed by hooks on a decoder layer's submodules (both capture and steering).
SUBLAYER_POINTS: tuple[str, ...] = ("attn_in", "attn_out", "mlp_in", "mlp_out")
#: Points a request may steer at: the sublayer points and the layer's output stream.
STEER_POINTS: tuple[str, ...] = SUBLAYER_POINTS + ("resid_post",)
#: Other spellings accepted on input (earlier names of the sites).
ALIASES: dict[str, str] = {"pre_attn": "attn_in", "post_attn": "attn_out"}

Site = tuple[str, int]  # (canonical point name, decoder layer index 0..num_layers-1)


def canonical_point(name: object, allowed: tuple[str, ...]) -> str:
    """The canonical name of ``name``; ``ValueError`` naming the allowed points otherwise."""
    point = ALIASES.get(name, name) if isinstance(name, str) else name
    if point not in allowed:
        raise ValueError(f"unknown point {name!r}: choose one of {list(allowed)} "
                         f"(aliases: {ALIASES})")
    return str(point)


def parse_sites(sites: Iterable[object]) -> tuple[Site, ...]:
    """``[(point, layer), ...]`` (tuples, lists or ``"point.layer"`` strings) as canonical sites.

    Raises ``ValueError`` for unknown points, negative or non-int layers, duplicates, and for
    ``resid_post`` (capture the residual stream through ``layers`` instead).
    """
    out: list[Site] = []
    for s in sites:
        if isinstance(s, str) and "." in s:
            name, _, layer_text = s.rpartition(".")
            s = (name, int(layer_text)) if layer_text.isdigit() else s
        if not isinstance(s, (tuple, list)) or len(s) != 2:
            raise ValueError(f"a capture point is (point, layer) or 'point.layer', got {s!r}")
        name, layer = s
        if name == "resid_post":
            raise ValueError("capture the residual stream with layers=[l + 1] (HF hidden-state index), "
                             "not the point 'resid_post'")
        point = canonical_point(name, SUBLAYER_POINTS)
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"point {point!r}: layer must be a decoder-layer index >= 0, got {layer!r}")
        out.append((point, int(layer)))
    if len(set(out)) != len(out):
        raise ValueError(f"capture points contain duplicates: {out}")
    return tuple(out)


def site_name(site: Site) -> str:
    """``"mlp_out.3"``: how a site is written in messages and metadata."""
    return f"{site[0]}.{site[1]}"


__all__ = ["ALIASES", "SUBLAYER_POINTS", "STEER_POINTS", "Site", "canonical_point", "parse_sites", "site_name"]
