"""What a polygraph_eval load script does: build a capturing ``vllm.LLM`` for a head, and check the
local dataset early.

polygraph_eval calls the model's load script before it loads the dataset or builds any estimator,
so this is the first place a misconfigured run can be stopped with a readable error.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

from ..errors import DatasetColumnError
from ..runtime import set_env_defaults
from .head_io import read_head_config


def check_csv_dataset(path: str | Path, text_column: str, label_column: str | None = None) -> list[str]:
    """Check that a local CSV exists and has the configured columns; return its header.

    lm-polygraph reads it with ``pandas.read_csv(path)[column]`` and, for a path that is not a
    file, silently tries a Hugging Face hub download instead, so both cases fail obscurely there.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"dataset file {p} not found (relative paths are relative to the directory polygraph_eval "
            "runs in); write it with experiments/polygraph/run_polygraph.py or "
            "uhead_vllm.tasks.write_polygraph_dataset"
        )
    with open(p, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    for key, col in (("text_column", text_column), ("label_column", label_column)):
        if col is not None and col not in header:
            raise DatasetColumnError(f"{key}={col!r} is not a column of {p}; its columns are {header}")
    return header


def capture_layers_for(head_path: str | Path | None, capture_layers: Sequence[int] | None) -> list[int]:
    """Layers to capture: explicit ones (must include the head's), else the head's recipe layers."""
    head_layers = None
    if head_path is not None:
        cfg = read_head_config(head_path)
        head_layers = list(cfg.layers or (cfg.recipe or {}).get("layers") or [])
        if not head_layers:
            raise ValueError(f"head {head_path} records no layers; cannot tell which layers to capture")
    if capture_layers is None:
        if head_layers is None:
            raise ValueError("give capture_layers or head_path so the engine knows which layers to capture")
        return head_layers
    layers = [int(x) for x in capture_layers]
    missing = sorted(set(head_layers or []) - set(layers))
    if missing:
        raise ValueError(f"capture_layers {layers} lack layers {missing} that head {head_path} needs")
    return layers


def load_capture_llm(
    model_path: str,
    max_new_tokens: int,
    logprobs: int,
    head_path: str | None = None,
    capture_layers: Sequence[int] | None = None,
    check_dataset: dict[str, Any] | None = None,
    **build_kwargs: Any,
) -> tuple[Any, Any]:
    """``(vllm.LLM with capture installed, SamplingParams)`` as polygraph_eval's vLLM path expects.

    ``model_path`` may be ``default`` (the embedded model) or a local HF folder. ``check_dataset``
    (``{path, text_column, label_column}``) is validated first, before the engine is built. Engine
    and capture settings (``build_kwargs``) go to :func:`uhead_vllm.generation.build_llm` unchanged.
    """
    if check_dataset:
        check_csv_dataset(check_dataset["path"], check_dataset["text_column"], check_dataset.get("label_column"))
    layers = capture_layers_for(head_path, capture_layers)
    set_env_defaults()  # in-process engine: fast load on CPU
    from vllm import SamplingParams

    from ..generation import build_llm
    from ..models import resolve_model

    llm = build_llm(str(resolve_model(model_path)), layers, **build_kwargs)
    return llm, SamplingParams(max_tokens=int(max_new_tokens), logprobs=int(logprobs))
