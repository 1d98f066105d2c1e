"""Collection on a local Ray cluster with two engine actors (the tiny test model): the dataset is
byte for byte the one a single process writes, also when the test kills an actor holding a unit,
and a run whose driver was killed after finishing a unit resumes from its finished units."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open

ray = pytest.importorskip("ray", reason="the extra 'ray' is not installed")

import uhead_vllm  # noqa: E402
from study_helpers import relabel  # noqa: E402
from uhead_vllm.scaleout import NAMESPACE, RayOptions  # noqa: E402
from uhead_vllm.scoring.recipe import GenerationRecipe  # noqa: E402
from uhead_vllm.study import commands  # noqa: E402
from uhead_vllm.study.collect import collect, plan_job  # noqa: E402
from uhead_vllm.study.data import MANIFEST_FILE  # noqa: E402

pytestmark = pytest.mark.slow  # every test here starts an engine, a server or a cluster

LAYERS = [1, 3]
TASKS = ["basic_arithmetic:6:0", "chain_sum:2:400000"]
SAMPLING = dict(max_tokens=12, temperature=0.8, samples=2, seed=5)
BATCH = 2  # 8 questions -> 4 units


def _recipe() -> GenerationRecipe:
    return GenerationRecipe("steps_plain", SAMPLING["max_tokens"], SAMPLING["temperature"], 10, "line",
                            SAMPLING["seed"], SAMPLING["samples"])


def _job(out: Path, model: Path) -> Any:
    """The job ``commands.collect`` (and the CLI) makes of the same arguments."""
    return plan_job(out, TASKS, model, LAYERS, _recipe(), batch_size=BATCH,
                    about={"model_path_name": model.name, "excluded_from": []})


def _tensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def _same_dataset(a: Path, b: Path) -> None:
    """Same files; answers byte for byte, every tensor bit for bit (a shard's header may list its
    metadata in another order: safetensors keeps it in a hash map), manifests equal but for the
    creation time."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name == MANIFEST_FILE:
            ma, mb = (json.loads((d / name).read_text()) for d in (a, b))
            ma.pop("created"), mb.pop("created")
            assert ma == mb
        elif name.endswith(".safetensors"):
            (meta_a, ta), (meta_b, tb) = _tensors(a / name), _tensors(b / name)
            assert meta_a == meta_b and ta.keys() == tb.keys() and ta, name
            assert all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta), name
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 240.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _finished_units(out: Path) -> list[Path]:
    return sorted(out.with_name(out.name + ".partial").glob("shard-*.jsonl"))


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process dataset (the engine lives in this process)."""
    out = tmp_path_factory.mktemp("single") / "data"
    commands.collect(out, TASKS, model=str(model), layers=LAYERS, batch_size=BATCH, progress=False, **SAMPLING)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["counts"]["total"]["answers"] == 8 * SAMPLING["samples"]
    assert manifest["units"] == {"count": 4, "questions_per_unit": BATCH, "questions": 8}
    return out


@pytest.fixture(scope="module")
def cluster() -> Any:
    """A local Ray cluster for the module (4 logical CPUs: a replacement actor never waits)."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_two_actors_write_the_single_process_dataset_even_when_one_is_killed(model, reference, cluster, tmp_path):
    out = tmp_path / "data"
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["path"], result["run"] = collect(_job(out, model), ray=RayOptions(replicas=2), progress=False)
        except BaseException as e:  # noqa: BLE001  (re-raised in the test thread)
            result["error"] = e

    def actors() -> list[dict[str, str]]:
        return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]

    thread = threading.Thread(target=run)
    thread.start()
    # Each actor holds its first unit from the start (while its engine loads): kill one then.
    _wait_for(lambda: len(actors()) == 2 or not thread.is_alive(), "two engine actors")
    assert not _finished_units(out)
    ray.kill(ray.get_actor(actors()[0]["name"], namespace=NAMESPACE), no_restart=True)
    thread.join(timeout=600)
    if "error" in result:
        raise result["error"]
    run = result["run"]
    assert run["actors_replaced"] == 1 and run["units_retried"] == 1 and run["actors_started"] == 3
    assert run["resumed_units"] == [] and run["rows"] > 0
    _same_dataset(result["path"], reference)
    assert not ray.util.list_named_actors(all_namespaces=True)  # the pool took its actors down


def test_a_run_whose_driver_was_killed_resumes_from_its_finished_units(model, reference, cluster, tmp_path):
    out = tmp_path / "data"
    cli = [sys.executable, "-m", "uhead_vllm.cli", "collect", "--out", str(out), "--tasks", *TASKS,
           "--model", str(model), "--layers", *map(str, LAYERS), "--batch-size", str(BATCH),
           "--max-tokens", str(SAMPLING["max_tokens"]), "--temperature", str(SAMPLING["temperature"]),
           "--samples", str(SAMPLING["samples"]), "--seed", str(SAMPLING["seed"]), "--no-progress",
           "--ray", cluster, "--replicas", "1"]
    log = tmp_path / "driver.log"
    with open(log, "wb") as err:
        driver = subprocess.Popen(cli, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=err)
        try:
            _wait_for(lambda: _finished_units(out) or driver.poll() is not None, "the driver's first finished unit")
            assert driver.poll() is None, log.read_text()[-2000:]
            driver.send_signal(signal.SIGKILL)
        finally:
            driver.wait(timeout=60)
    finished = [int(p.name[6:11]) for p in _finished_units(out)]
    assert finished and len(finished) < 4 and not out.exists()
    path, run = collect(_job(out, model), ray=RayOptions(replicas=2), progress=False)
    # Its actor may still finish the unit it held before Ray reaps it: then that one is resumed too.
    assert set(finished) <= set(run["resumed_units"]) and len(run["resumed_units"]) < 4 and run["rows"] > 0
    _same_dataset(path, reference)


def test_the_main_job_on_two_actors_answers_like_one_process(model, reference, cluster, tmp_path):
    data = tmp_path / "relabelled"
    shutil.copytree(reference, data)
    relabel(data)
    head = commands.train([data], tmp_path / "head", head="linear", level="step", progress=False)
    questions = [f"What is {a} + {b}?" for a, b in [(2, 3), (17, 25), (9, 9), (40, 2), (6, 71)]]
    kwargs = dict(model=str(model), batch_size=2, as_json=True, file=io.StringIO())
    here = uhead_vllm.answer(questions, head, **kwargs)
    there = uhead_vllm.answer(questions, head, ray=RayOptions(replicas=2), **kwargs)
    assert [a.question for a in there] == questions
    # Same answers and steps; the head's arithmetic may run on another number of threads in an
    # actor (vLLM pins this process's), so its probabilities agree to float rounding.
    assert [(a.text, a.finish_reason, [(s.text, s.start, s.end) for s in a.steps]) for a in there] == \
        [(a.text, a.finish_reason, [(s.text, s.start, s.end) for s in a.steps]) for a in here]
    for a, b in zip(there, here):
        assert a.uncertainty == pytest.approx(b.uncertainty, abs=1e-6)
        assert [s.uncertainty for s in a.steps] == pytest.approx([s.uncertainty for s in b.steps], abs=1e-6)
    assert all(0.0 <= a.uncertainty <= 1.0 and any(s.uncertainty is not None for s in a.steps) for a in here)
