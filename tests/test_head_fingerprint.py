"""A head knows the weights it was trained on: other weights under the same name and shapes (a
fine-tune) are refused with a clear error, unless explicitly allowed. No engine is started."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from uhead_vllm.features import FeatureRecipe
from uhead_vllm.heads import HeadMismatchError, LinearProbeHead, default_head_dir, load_head, load_head_for_model
from uhead_vllm.envs import ALLOW_OTHER_WEIGHTS_ENV
from uhead_vllm.models import model_identity, weights_fingerprint

LAYERS = [2, 4]


def copy_model(src: Path, dst: Path, change=None, shards: int = 1) -> Path:
    """Copy a model folder (same folder name under ``dst``); ``change`` edits the tensors first;
    ``shards`` > 1 splits them over several safetensors files with an index, as HF does."""
    out = dst / src.name
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if change is not None:
        change(tensors)
    names = sorted(tensors)
    parts = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    if shards > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def finetune(tensors: dict[str, torch.Tensor]) -> None:
    """What a small fine-tune does: nudges every value of one layer's attention projection."""
    name = next(n for n in sorted(tensors) if "layers.1." in n and "q_proj.weight" in n)
    tensors[name] = tensors[name] + 1e-3 * torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(0))


def saved_head(identity: dict, hidden: int, out: Path) -> Path:
    recipe = FeatureRecipe(LAYERS)
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(5, recipe.token_dim(hidden), generator=gen) for _ in range(20)]
    head = LinearProbeHead(recipe=recipe, model_identity=identity).fit(steps, np.arange(20) % 2)
    return head.save(out)


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    src = tiny_models["llama"]
    root = tmp_path_factory.mktemp("models")
    return {
        "original": src,
        "copy": copy_model(src, root / "copy"),
        "resharded": copy_model(src, root / "resharded", shards=3),
        "finetune": copy_model(src, root / "finetune", change=finetune),
    }


def test_fingerprint_follows_the_weights_not_the_files(models):
    fp = weights_fingerprint(models["original"])
    assert fp and fp.startswith("sha256:")
    assert weights_fingerprint(models["copy"]) == fp
    assert weights_fingerprint(models["resharded"]) == fp  # same tensors, other files
    assert weights_fingerprint(models["finetune"]) != fp
    # The name-and-shapes identity alone cannot tell the fine-tune apart: that is why the
    # fingerprint exists.
    strip = lambda d: {k: v for k, v in d.items() if k != "weights_fingerprint"}  # noqa: E731
    assert strip(model_identity(models["finetune"])) == strip(model_identity(models["original"]))
    assert weights_fingerprint(models["original"].parent) is None  # no safetensors: unknown


def test_head_for_other_weights_is_refused_unless_allowed(models, tmp_path, monkeypatch):
    monkeypatch.delenv(ALLOW_OTHER_WEIGHTS_ENV, raising=False)
    hidden = model_identity(models["original"])["hidden_size"]
    head_dir = saved_head(model_identity(models["original"]), hidden, tmp_path / "head")
    for same in ("original", "copy", "resharded"):
        load_head_for_model(head_dir, models[same])
    with pytest.raises(HeadMismatchError, match="other weights.*allow_other_weights"):
        load_head_for_model(head_dir, models["finetune"])
    head = load_head_for_model(head_dir, models["finetune"], allow_other_weights=True)
    assert head.model_identity["weights_fingerprint"] == weights_fingerprint(models["original"])
    monkeypatch.setenv(ALLOW_OTHER_WEIGHTS_ENV, "1")
    load_head_for_model(head_dir, models["finetune"])
    monkeypatch.delenv(ALLOW_OTHER_WEIGHTS_ENV)
    # A model whose weights cannot be fingerprinted is not silently accepted either.
    unknown = {**model_identity(models["original"]), "weights_fingerprint": None}
    with pytest.raises(HeadMismatchError, match="cannot be fingerprinted"):
        load_head(head_dir, expect_model_identity=unknown)
    # A head saved before fingerprints existed is accepted (nothing to compare).
    old = {k: v for k, v in model_identity(models["original"]).items() if k != "weights_fingerprint"}
    load_head_for_model(saved_head(old, hidden, tmp_path / "old"), models["finetune"])


def test_cli_refuses_a_head_for_other_weights_in_one_line(models, tmp_path, capsys):
    from uhead_vllm.cli import main

    hidden = model_identity(models["original"])["hidden_size"]
    head_dir = saved_head(model_identity(models["original"]), hidden, tmp_path / "head")
    rc = main(["answer", "--model", str(models["finetune"]), "--head", str(head_dir), "What is 1 + 1?"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "other weights" in err[0] and "--allow-other-weights" in err[0]


def test_default_head_carries_the_embedded_model_fingerprint(embedded_model):
    config = json.loads((default_head_dir() / "config.json").read_text())
    fp = config["model_identity"]["weights_fingerprint"]
    assert fp == weights_fingerprint(embedded_model)
    load_head_for_model(None, embedded_model)
