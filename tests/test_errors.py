"""One base exception: every deliberate error is a ``UheadError``; a damaged head folder says so
(never ``JSONDecodeError`` / ``TypeError`` / ``SafetensorError``); the CLI prints one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from uhead_vllm.errors import UheadError
from uhead_vllm.features import FeatureRecipe
from uhead_vllm.heads import AttentionPoolingHead, HeadFormatError, LinearProbeHead, load_head

IDENTITY = {"name": "tiny", "architecture": "LlamaForCausalLM", "hidden_size": 8, "num_hidden_layers": 4}
RECIPE = FeatureRecipe([2, 4])


@pytest.fixture(scope="module", params=["linear", "attention"])
def head_dir(request, tmp_path_factory) -> Path:
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(4, RECIPE.token_dim(8), generator=gen) for _ in range(16)]
    if request.param == "linear":
        head = LinearProbeHead(recipe=RECIPE, model_identity=IDENTITY)
    else:
        head = AttentionPoolingHead(recipe=RECIPE, model_identity=IDENTITY, d_model=16, nhead=2,
                                    dim_feedforward=16, max_epochs=1, progress=False)
    return head.fit(steps, np.arange(16) % 2).save(tmp_path_factory.mktemp("heads") / request.param)


def damaged(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    cfg, weights = dst / "config.json", dst / "weights.safetensors"
    if how == "truncated config":
        cfg.write_text(cfg.read_text()[: 40])
    elif how == "config not an object":
        cfg.write_text("[1, 2]")
    elif how == "config missing a key":
        data = json.loads(cfg.read_text())
        del data["n_features"]
        cfg.write_text(json.dumps(data))
    elif how == "config with an unknown key":
        data = json.loads(cfg.read_text())
        data["hyperparameters"]["not_a_parameter"] = 1
        cfg.write_text(json.dumps(data))
    elif how == "invalid usage":
        data = json.loads(cfg.read_text())
        data["usage"] = {"level": "sentence", "answer_scoring": "span"}
        cfg.write_text(json.dumps(data))
    elif how == "no config":
        cfg.unlink()
    elif how == "no weights":
        weights.unlink()
    elif how == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "missing tensor":
        tensors = load_file(str(weights))
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, str(weights))
    return dst


HOW = ["truncated config", "config not an object", "config missing a key", "config with an unknown key",
       "invalid usage", "no config", "no weights", "truncated weights", "missing tensor"]


@pytest.mark.parametrize("how", HOW)
def test_damaged_head_folder_gives_a_clear_error(head_dir, tmp_path, how):
    bad = damaged(head_dir, tmp_path / "bad", how)
    with pytest.raises(HeadFormatError) as err:
        load_head(bad)
    assert isinstance(err.value, UheadError)
    assert str(bad) in str(err.value)
    load_head(head_dir)  # the intact original still loads


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated config", "truncated weights"])
def test_cli_reports_a_damaged_head_in_one_line(tmp_path, capsys, how, tiny_models):
    from uhead_vllm.cli import main
    from uhead_vllm.models import model_identity

    ident = model_identity(tiny_models["llama"])  # a head for this model, so only the damage can stop it
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(4, RECIPE.token_dim(ident["hidden_size"]), generator=gen) for _ in range(16)]
    good = LinearProbeHead(recipe=RECIPE, model_identity=ident).fit(steps, np.arange(16) % 2).save(tmp_path / "good")
    bad = damaged(good, tmp_path / "bad", how)
    rc = main(["answer", "--model", str(tiny_models["llama"]), "--head", str(bad), "What is 1 + 1?"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("uhead-vllm answer: error:") and str(bad) in err[0]


def test_every_package_error_is_a_uhead_error():
    from uhead_vllm.generation import CaptureError, CaptureNotInstalledError, MissingRowsError
    from uhead_vllm.heads import HeadMismatchError
    from uhead_vllm.models import ModelNotAvailableError
    from uhead_vllm.polygraph.adapter import LogprobsMissingError
    from uhead_vllm.polygraph.head_io import HeadNotFoundError
    from uhead_vllm.polygraph.loading import DatasetColumnError
    from uhead_vllm.study.data import DatasetError

    for cls, builtin in [(CaptureError, RuntimeError), (MissingRowsError, RuntimeError),
                         (CaptureNotInstalledError, RuntimeError), (HeadMismatchError, ValueError),
                         (HeadFormatError, ValueError), (ModelNotAvailableError, RuntimeError),
                         (LogprobsMissingError, ValueError), (HeadNotFoundError, FileNotFoundError),
                         (DatasetColumnError, KeyError), (DatasetError, ValueError)]:
        assert issubclass(cls, UheadError) and issubclass(cls, builtin), cls


@pytest.mark.slow
@pytest.mark.multiproc
def test_dead_engine_is_reported_as_dead(multiprocess_run):
    """Kill the engine core of a multiprocess engine (the session's, multiprocess_engine.py, once
    its capture checks ran): both a generate call and a new generator name a dead engine, not a
    missing capture extension."""
    multiprocess_run.check_ran()
    result = json.loads(multiprocess_run.dead.read_text())
    for what in ("generate", "client"):
        assert result[what] and result[what].startswith("uhead_vllm.errors.EngineDeadError"), result


def test_cli_exit_codes():
    from uhead_vllm.capture.architectures import EngineDefectError
    from uhead_vllm.cli import error_exit_code
    from uhead_vllm.errors import EngineDeadError
    from uhead_vllm.generation import CaptureError, MissingRowsError
    from uhead_vllm.heads import HeadMismatchError

    assert error_exit_code(CaptureError("budget")) == 1
    assert error_exit_code(MissingRowsError("strict")) == 1
    assert error_exit_code(EngineDeadError("dead")) == 1
    assert error_exit_code(EngineDefectError("rotary")) == 1
    assert error_exit_code(HeadMismatchError("other model")) == 2
    assert error_exit_code(KeyError("a bug")) is None  # bugs keep their traceback


@pytest.mark.slow
def test_no_package_shadows_its_modules_and_answer_stays_a_function():
    """No package binds a non-module to the name of one of its modules: Python rebinds a package
    attribute to the submodule when that is first imported (``uhead_vllm.study.answer`` the
    function used to become the module, so a second call raised ``TypeError: 'module' object is
    not callable``). Fresh interpreter; every module of the package imported; the public
    ``uhead_vllm.answer`` called before and after that."""
    import os
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, types\n"
        "import uhead_vllm\n"
        "def ask_twice():\n"
        "    for _ in range(2):\n"
        "        try:\n"
        "            uhead_vllm.answer(['   '])\n"
        "        except ValueError as exc:\n"
        "            assert 'question' in str(exc), exc\n"
        "        else:\n"
        "            raise AssertionError('an empty question was accepted')\n"
        "ask_twice()\n"
        "mods = [importlib.import_module(m.name) for m in pkgutil.walk_packages(uhead_vllm.__path__, 'uhead_vllm.')]\n"
        "packages = [uhead_vllm] + [m for m in mods if hasattr(m, '__path__')]\n"
        "shadowed = [f'{p.__name__}.{m.name}' for p in packages for m in pkgutil.iter_modules(p.__path__)\n"
        "            if not isinstance(getattr(p, m.name, None), (types.ModuleType, type(None)))]\n"
        "assert not shadowed, shadowed\n"
        "assert len(mods) > 40 and 'uhead_vllm.scoring.answer' in {m.__name__ for m in mods}\n"
        "ask_twice()\n"
        "assert callable(uhead_vllm.answer) and uhead_vllm.answer.__module__ == 'uhead_vllm.scoring.answer'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_sequence_estimator_auto_scores_a_step_head_by_its_worst_step(tmp_path):
    """``UHeadSequence(reduce="auto")`` reads the head's usage, saved with the head: a head that
    scores answers by their worst step (trained on steps) reduces claims by max; a head trained on
    answers applies to the whole answer. The default head is a format-1 head: its usage is read
    from where training stored it then (``training["study"]``, ``answer_scoring: max_step``)."""
    from uhead_vllm.heads import HeadUsage, default_head_dir, load_head
    from uhead_vllm.polygraph.estimators import UHeadSequence

    config = json.loads((default_head_dir() / "config.json").read_text())
    assert config["training"]["study"]["answer_scoring"] == "max_step"  # the independent fact
    assert "usage" not in config and config["format_version"] == 1
    assert load_head(default_head_dir()).usage == HeadUsage("step", "max_step", config["training"]["study"]["generation"])
    assert UHeadSequence("default").reduce == "max"
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(4, RECIPE.token_dim(8), generator=gen) for _ in range(16)]
    head = LinearProbeHead(recipe=RECIPE, model_identity=IDENTITY).fit(steps, np.arange(16) % 2)
    head.training_summary_ = {"study": {"level": "answer", "answer_scoring": "span"}}  # format-1 style
    assert UHeadSequence(str(head.save(tmp_path / "answer_head_v1"))).reduce == "whole"
    head.training_summary_ = {}
    for level, reduce in (("step", "max"), ("answer", "whole"), ("joint", "whole")):
        head.usage = HeadUsage.for_level(level, {"style": "steps_plain", "split_mode": "line"})
        saved = head.save(tmp_path / f"{level}_head")
        assert json.loads((saved / "config.json").read_text())["usage"]["level"] == level
        assert load_head(saved).usage == head.usage
        assert UHeadSequence(str(saved)).reduce == reduce

