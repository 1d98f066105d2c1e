"""Row-by-row checks of raw captured rows against the Hugging Face reference."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from reference import hf_rows, relative_error


def check_raw_rows(model: Path, sequences: dict[int, Sequence[int]], tags: torch.Tensor,
                   positions: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor,
                   layers: Sequence[int], tol: float) -> int:
    """Every captured row: input token equals the sequence's token and hidden equals HF. Returns rows checked."""
    assert tags.numel() > 0, "nothing was captured"
    checked = 0
    for tag, seq in sequences.items():
        m = tags == tag
        assert m.any(), f"no rows captured for tag {tag}"
        pos = positions[m]
        seq_t = torch.tensor(list(seq))
        assert int(pos.max()) < len(seq) - 1 or int(pos.max()) == len(seq) - 1
        assert torch.equal(token_ids[m], seq_t[pos]), f"tag {tag}: captured input tokens differ"
        ref = hf_rows(str(model), seq, layers)[pos]
        err = relative_error(hidden[m], ref)
        assert err < tol, f"tag {tag}: relative error {err:.3g} >= {tol}"
        checked += int(m.sum())
    return checked
