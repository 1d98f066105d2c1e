"""Finding, checking and loading the saved head a polygraph_eval run uses.

Errors here are meant to be read by someone who only edited a YAML file: they name the path, what
is wrong and which config key to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import HeadNotFoundError
from ..features import FeatureRecipe
from ..heads import HeadConfig, HeadMismatchError, UncertaintyHead, default_head_dir, load_head
from ..heads.base import CONFIG_FILE, WEIGHTS_FILE, check_compatible
from .adapter import model_folder

DEFAULT_HEAD_ALIAS = "default"


def resolve_head_dir(head_path: str | Path | None) -> Path:
    """Directory of a saved head (``default`` = the shipped head); raises if it is incomplete."""
    if head_path is None or str(head_path).strip() == "":
        raise HeadNotFoundError("no uncertainty head configured: set uhead.head_path (a saved head directory or 'default')")
    is_default = str(head_path).strip() == DEFAULT_HEAD_ALIAS
    path = default_head_dir() if is_default else Path(head_path).expanduser()
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (path / name).is_file()]
    if missing:
        what = f"the default head for the embedded model ({path})" if is_default else f"{path}"
        raise HeadNotFoundError(
            f"no saved uncertainty head at {what}: missing {', '.join(missing)}. Train and save one "
            "(head.save(dir), see docs/integrations.md) and point uhead.head_path=<dir> at it"
            + ("; the default head has not been produced in this checkout yet" if is_default else "")
        )
    return path.resolve()


def read_head_config(head_path: str | Path | None) -> HeadConfig:
    """The head's ``config.json`` (metadata only, no weights)."""
    return HeadConfig.load(resolve_head_dir(head_path) / CONFIG_FILE)


def head_recipe(config: HeadConfig, where: str = "") -> FeatureRecipe:
    """Feature recipe stored with a head; a head without one cannot be applied to hidden states."""
    if config.recipe is None:
        raise HeadMismatchError(f"head {where} has no feature recipe; save heads with recipe=FeatureRecipe(...)")
    return FeatureRecipe.from_dict(config.recipe)


def served_model_identity(model: Any) -> dict[str, Any]:
    """Identity (name, architecture, sizes) of the model behind an adapter or ``vllm.LLM``."""
    from ..heads import identity_from_hf_config
    from ..models import model_identity

    folder = model_folder(model)
    if folder is not None:
        return model_identity(folder)
    llm = getattr(model, "model", model)
    return identity_from_hf_config(str(llm.model_config.model), llm.model_config.hf_config)


def check_head_for_model(config: HeadConfig, identity: dict[str, Any], where: str = "",
                         allow_other_weights: bool = False) -> None:
    """Raise :class:`HeadMismatchError` if the head was trained for another model (or other weights)."""
    try:
        check_compatible(config, expect_model_identity=identity, allow_other_weights=allow_other_weights)
    except HeadMismatchError as exc:
        raise HeadMismatchError(
            f"head {where} does not fit the served model {identity.get('name')!r}: {exc}. Use a head "
            "trained on this model's hidden states (uhead.head_path) or serve the model it was trained for"
        ) from exc


def load_checked_head(head_path: str | Path | None) -> tuple[UncertaintyHead, Path]:
    """Load a head (any type) after checking its files exist."""
    path = resolve_head_dir(head_path)
    return load_head(path), path
