"""A head's token-inputs weight on disk, for the worker (``CaptureSettings.token_inputs``).

The weight ``[D, L * H]`` float32 maps a token's captured layers (in the listed order,
concatenated) to the head's ``D`` inputs (heads/token_inputs.py builds it). It travels as a
safetensors file with its layers in the metadata: reading it never runs code.
"""

from __future__ import annotations

import json
from typing import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def save_weight(path: str, layers: Sequence[int], weight: torch.Tensor) -> None:
    """Write ``weight`` and the ``layers`` it reads to ``path``."""
    save_file({"weight": weight.to(torch.float32).contiguous()}, path,
              metadata={"layers": json.dumps([int(k) for k in layers])})


def load_weight(path: str) -> tuple[tuple[int, ...], torch.Tensor]:
    """(layers, weight ``[D, L * H]`` float32) of a file :func:`save_weight` wrote; ``ValueError``
    for anything else."""
    try:
        with safe_open(path, framework="pt") as f:
            layers = tuple(int(k) for k in json.loads((f.metadata() or {})["layers"]))
            weight = f.get_tensor("weight")
    except Exception as exc:  # missing, not safetensors, no layers: one clear message
        raise ValueError(f"{path}: not a token-inputs file (safetensors with 'weight' and its 'layers'): {exc}") from None
    if weight.dim() != 2 or weight.dtype != torch.float32 or not layers or weight.shape[0] == 0:
        raise ValueError(f"{path}: the token-inputs weight must be a non-empty [D, L * H] float32 matrix with its layers")
    return layers, weight
