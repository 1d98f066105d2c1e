"""Hugging Face reference for parity checks: the same token ids through transformers' forward.

HF index convention: ``hidden_states[k]`` is the residual stream after decoder layer k-1 (0 =
embeddings). transformers 5 ties the last entry to the *normed* output by default; the capture
contract keeps the stream before the final norm, so the reference sets
``config.tie_last_hidden_states = False``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch


@lru_cache(maxsize=4)
def hf_model(path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.config.tie_last_hidden_states = False
    return model.eval()


@torch.no_grad()
def hf_rows(path: str | Path, token_ids: Sequence[int], layers: Sequence[int], dtype: str = "float32") -> torch.Tensor:
    """``[len(token_ids), len(layers), H]`` reference rows in float32."""
    model = hf_model(str(path), dtype)
    out = model(torch.tensor([list(token_ids)]), output_hidden_states=True)
    return torch.stack([out.hidden_states[k][0] for k in layers], dim=1).float()


#: Tolerances of :func:`relative_error` used everywhere: fp32 capture of an fp32 forward, and bf16
#: storage of it (bf16 keeps 8 significant bits: ≈0.4% per entry, ≈0.3% over a row; 2% leaves room
#: without letting a wrong row, typically ≥20% away, through).
FP32_TOL = 1e-4
BF16_TOL = 2e-2


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max over rows and layers of ||got - ref|| / ||ref|| (L2 over the hidden dimension).

    Normalised by the row's norm, not its largest entry: residual streams have outlier channels
    hundreds of times larger than the rest, and a max-entry scale would let errors everywhere
    else pass unnoticed.
    """
    got, ref = got.float(), ref.float()
    scale = ref.norm(dim=-1).clamp_min(1e-12)
    return float(((got - ref).norm(dim=-1) / scale).max())


def assert_rows_match(path, token_ids, hidden: torch.Tensor, layers, tol: float, dtype: str = "float32",
                      first_row: int = 0) -> float:
    """Every row of ``hidden`` (aligned to token_ids from position ``first_row``, a capture
    window's start) equals the reference."""
    assert first_row + hidden.shape[0] in (len(token_ids), len(token_ids) - 1), (first_row, hidden.shape, len(token_ids))
    assert hidden.shape[1] == len(layers)
    ref = hf_rows(path, token_ids, layers, dtype)[first_row : first_row + hidden.shape[0]]
    err = relative_error(hidden, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol} over {hidden.shape[0]} rows"
    return err
