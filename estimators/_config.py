"""Turn a Hydra/OmegaConf node into plain Python values for our constructors."""

from __future__ import annotations

from typing import Any


def plain(cfg: Any) -> dict[str, Any]:
    """``cfg`` (DictConfig, dict or None) as a resolved plain dict."""
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - hydra is a dependency
        return dict(cfg)
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)
