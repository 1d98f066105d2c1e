"""Load any saved head by the type recorded in its ``config.json``; where the default head lives."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .. import envs
from ..envs import HEAD_DIR_ENV
from . import attention as _attention  # noqa: F401  (registers AttentionPoolingHead)
from . import linear as _linear  # noqa: F401  (registers LinearProbeHead)
from .base import UncertaintyHead



def default_head_dir() -> Path:
    """``$UHEAD_VLLM_HEAD_DIR`` or ``uhead_vllm/heads/default/``: the head shipped for the embedded
    model, produced by ``uhead-vllm study`` (recipe in its ``RECIPE.md``)."""
    return envs.head_dir() or Path(__file__).resolve().parent / "default"


def ranking_head_dir() -> Path:
    """``uhead_vllm/heads/value_ranking/``: the ranking head of the value study (docs/value_study.md),
    trained on the sibling candidates best-of-n chooses between, for the embedded model; pass it as
    ``head_dir`` where a step scorer for best-of-n or beam search is wanted."""
    return Path(__file__).resolve().parent / "value_ranking"


def load_head(
    directory: str | Path,
    expect_model_identity: dict[str, Any] | None = None,
    expect_layers: Sequence[int] | None = None,
    allow_other_weights: bool = False,
) -> UncertaintyHead:
    """Load the head saved in ``directory`` whatever its type, with the same checks as ``load``."""
    return UncertaintyHead.load(directory, expect_model_identity, expect_layers, allow_other_weights)


def load_head_for_model(head_dir: str | Path | None, model_path: str | Path,
                        allow_other_weights: bool = False) -> UncertaintyHead:
    """Load the head in ``head_dir`` (None: :func:`default_head_dir`) and check it was trained on
    the model in ``model_path``, its weights included (:class:`HeadMismatchError` if not)."""
    from ..models import model_identity

    path = Path(head_dir).expanduser() if head_dir is not None else default_head_dir()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no uncertainty head at {path} (config.json missing): train one with `uhead-vllm train` "
            f"(or `uhead-vllm study`), or point head_dir / ${HEAD_DIR_ENV} at a saved head"
        )
    return load_head(path, expect_model_identity=model_identity(model_path), allow_other_weights=allow_other_weights)
