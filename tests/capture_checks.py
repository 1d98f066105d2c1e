"""Row-by-row checks of raw captured rows against the Hugging Face reference."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from reference import hf_rows, relative_error
from uhead_vllm.models import model_identity


def layers_for(model: Path) -> tuple[int, ...]:
    """The first, middle and last HF hidden-state index of ``model``."""
    n = model_identity(model)["num_hidden_layers"]
    return (0, n // 2, n)


def check_raw_rows(model: Path, sequences: dict[int, Sequence[int]], tags: torch.Tensor,
                   positions: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor,
                   layers: Sequence[int], tol: float, block_size: int = 32) -> dict[int, int]:
    """Every captured row: input token equals the sequence's token and hidden equals HF; every
    position vLLM forwarded is there exactly once: all of them from the first position not served
    by the prefix cache (a whole number of blocks) to the last forwarded token (the last sampled
    token never is). Returns that first position per tag."""
    assert tags.numel() > 0, "nothing was captured"
    firsts = {}
    for tag, seq in sequences.items():
        m = tags == tag
        assert m.any(), f"no rows captured for tag {tag}"
        pos = positions[m]
        seq_t = torch.tensor(list(seq))
        first = int(pos.min())
        assert first % block_size == 0, f"tag {tag}: first captured position {first} is inside a block"
        assert torch.equal(pos.sort().values, torch.arange(first, len(seq) - 1)), (
            f"tag {tag}: captured positions are not exactly {first}..{len(seq) - 2}")
        assert torch.equal(token_ids[m], seq_t[pos]), f"tag {tag}: captured input tokens differ"
        ref = hf_rows(str(model), seq, layers)[pos]
        err = relative_error(hidden[m], ref)
        assert err < tol, f"tag {tag}: relative error {err:.3g} >= {tol}"
        firsts[tag] = first
    return firsts
