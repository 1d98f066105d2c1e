"""Load any saved head by the type recorded in its ``config.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from . import attention as _attention  # noqa: F401  (registers AttentionPoolingHead)
from . import linear as _linear  # noqa: F401  (registers LinearProbeHead)
from .base import UncertaintyHead


def load_head(
    directory: str | Path,
    expect_model_identity: dict[str, Any] | None = None,
    expect_layers: Sequence[int] | None = None,
) -> UncertaintyHead:
    """Load the head saved in ``directory`` whatever its type, with the same checks as ``load``."""
    return UncertaintyHead.load(directory, expect_model_identity, expect_layers)
