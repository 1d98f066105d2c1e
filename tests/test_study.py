"""Study pipeline end to end on a tiny model: collect -> train -> evaluate -> answer.

The tiny model is random, so its answers are all wrong and its steps uncheckable; the test flips
labels (and rewrites the manifest's file sizes) so heads have two classes to learn from. It checks
the plumbing and the stored data, not the quality of the numbers — experiments/ measures those.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from conftest import make_vllm_kwargs
from study_helpers import relabel
import uhead_vllm
from uhead_vllm.heads import HeadMismatchError, load_head
from uhead_vllm.models import model_identity
from uhead_vllm.study import commands
from uhead_vllm.heads import default_head_dir
from uhead_vllm.scoring.scored import ScoredAnswer
from uhead_vllm.study.data import MANIFEST_FILE, DatasetError, StudyDataset

LAYERS = (1, 3)
TASKS = ["basic_arithmetic:6:0", "chain_sum:4:100000"]


@pytest.fixture(scope="module")
def tiny(tiny_models):
    from uhead_vllm.scoring.recipe import build_job_generator

    model = tiny_models["llama"]
    gen = build_job_generator(model, LAYERS, **make_vllm_kwargs(kv_cache_memory_bytes=32 << 20, max_num_seqs=16))
    calls = []
    original = gen.generate

    def recording_generate(*args, **kwargs):
        res = original(*args, **kwargs)
        calls.append(res)
        return res

    gen.generate = recording_generate
    yield model, gen, calls
    del gen.generate  # breaks the gen -> wrapper -> gen cycle, so the engine goes with its last reference
    calls.clear()


@pytest.fixture(scope="module")
def dataset(tiny, tmp_path_factory):
    model, gen, calls = tiny
    out = tmp_path_factory.mktemp("study") / "train"
    calls.clear()
    commands.collect(out, TASKS, model=str(model), layers=LAYERS, max_tokens=12, batch_size=4,
                     progress=False, generator=gen)
    return out, list(calls)


@pytest.mark.slow
def test_collect_writes_manifest_answers_and_exact_rows(tiny, dataset):
    model, gen, _ = tiny
    out, calls = dataset
    ds = StudyDataset(out)
    m = ds.manifest
    assert m["model_identity"] == model_identity(model)
    assert m["layers"] == list(LAYERS) and m["capture_dtype"] == "bfloat16"
    assert m["recipe"]["style"] == "steps_plain" and m["recipe"]["logprobs"] == 10
    assert [t["task"] for t in m["tasks"]] == ["basic_arithmetic", "chain_sum"]
    assert m["counts"]["total"]["answers"] == len(ds) == 10
    assert set(m["files"]) == {p.name for p in out.iterdir() if p.name != MANIFEST_FILE}
    generated = [s[0] for res in calls for s in res.hidden_states]
    outputs = [ro.outputs[0] for res in calls for ro in res.outputs]
    assert len(generated) == len(ds)
    for i, (rec, arrays) in enumerate(ds.iter_arrays()):
        sample, output = generated[i], outputs[i]
        assert arrays.token_ids.tolist() == list(output.token_ids) == sample.output_token_ids
        assert arrays.hidden.dtype == torch.bfloat16
        assert torch.equal(arrays.hidden, sample.generated_rows())  # bit-exact round trip
        assert arrays.topk_logprobs.shape == (rec.n_tokens, 10)
        assert (arrays.topk_logprobs[:, :-1] >= arrays.topk_logprobs[:, 1:]).all()
        assert arrays.token_logprobs[0] == output.logprobs[0][output.token_ids[0]].logprob
        assert rec.n_rows == rec.n_tokens - 1
        assert rec.steps and rec.steps[0].start == 0 and rec.steps[-1].end == rec.n_tokens
        assert set(rec.baselines) == {"msp", "perplexity", "mean_entropy", "length"}
    # The same random model answers the same prompt the same way: test split excludes train questions.
    test_out = out.parent / "test"
    commands.collect(test_out, ["basic_arithmetic:3:0"], model=str(model), layers=LAYERS, max_tokens=4,
                     exclude_from=[out], progress=False, generator=gen)
    seen = {a.question for a in ds.answers}
    assert not seen & {a.question for a in StudyDataset(test_out).answers}


@pytest.mark.slow
def test_compare_datasets_sees_one_changed_value_and_ignores_creation_time(dataset, tmp_path):
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from uhead_vllm.study.data import compare_datasets

    out, _ = dataset
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["created"] = "another time"
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert compare_datasets(out, copy)["identical"]
    shard = sorted(copy.glob("shard-*.safetensors"))[0]
    with safe_open(str(shard), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = next(k for k in tensors if k.endswith(".hidden"))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] += 0.5
    save_file(tensors, str(shard), metadata=meta)
    diff = compare_datasets(out, copy)
    assert not diff["identical"] and diff["tensors_differing"] == 1 and diff["answers_identical"]
    assert diff["max_abs_diff"] == pytest.approx(0.5, rel=0.02)  # bf16 rows


@pytest.mark.slow
def test_train_evaluate_answer(tiny, dataset, tmp_path, capsys):
    model, gen, _ = tiny
    out, _ = dataset
    data = tmp_path / "relabelled"
    import shutil

    shutil.copytree(out, data)
    relabel(data)
    lin = commands.train([data], tmp_path / "lin", head="linear", level="step", progress=False)
    att = commands.train([data], tmp_path / "att", head="attention", level="joint", progress=False,
                         hyper={"max_epochs": 2, "d_model": 16, "dim_feedforward": 16, "nhead": 2})
    assert (att / "weights.safetensors").is_file()
    with pytest.raises(FileExistsError):
        commands.train([data], tmp_path / "lin", head="linear", progress=False)
    res = commands.evaluate({"lin": lin, "att": att}, {"test": data}, tmp_path / "eval", n_boot=20, progress=False)
    answer_level = res["sets"]["test"]["answer"]
    assert {"lin", "att", "msp", "perplexity", "mean_entropy", "length"} <= set(answer_level["methods"])
    assert res["sets"]["test"]["step"]["n"] > 0
    files = {p.name for p in (tmp_path / "eval").iterdir()}
    assert {"results.json", "results.md", "rejection_test_answer.png", "calibration_test_step_lin.png"} <= files
    assert res["calibration_head"] == "lin"  # the plot's file name says whose calibration it shows

    scored = uhead_vllm.answer(["What is 2 + 3?", "Calculate 7 * 6."], att, model=str(model), max_tokens=8,
                               generator=gen)
    assert len(scored) == 2 and all(isinstance(s, ScoredAnswer) for s in scored)
    for s in scored:
        assert 0.0 <= s.uncertainty <= 1.0 and s.steps
        assert any(st.uncertainty is not None and 0.0 <= st.uncertainty <= 1.0 for st in s.steps)
    assert "P(wrong)" in capsys.readouterr().out
    # The main job is a function for good: a second call in this process (after its module and
    # the study's have been imported and used) scores the same answers the same way.
    import importlib

    for module in ("uhead_vllm.scoring.answer", "uhead_vllm.study.commands"):
        importlib.import_module(module)

    again = uhead_vllm.answer(["What is 2 + 3?", "Calculate 7 * 6."], att, model=str(model), max_tokens=8,
                              generator=gen, as_json=True)
    assert [a.to_dict() for a in again] == [s.to_dict() for s in scored]
    assert json.loads(capsys.readouterr().out) == [s.to_dict() for s in scored]


@pytest.mark.slow
def test_collect_several_sampled_answers_per_question(tiny, dataset, tmp_path):
    """samples=n keeps every sample (own rows, own grade); such a set trains next to a greedy one."""
    model, gen, calls = tiny
    calls.clear()
    out = commands.collect(tmp_path / "sampled", ["basic_arithmetic:3:0"], model=str(model), layers=LAYERS,
                           max_tokens=6, temperature=1.0, samples=3, seed=5, progress=False, generator=gen)
    ds = StudyDataset(out)
    generated = [s for res in calls for per_prompt in res.hidden_states for s in per_prompt]
    assert len(ds) == len(generated) == 9 and ds.manifest["recipe"]["samples"] == 3
    assert len({a.question for a in ds.answers}) == 3
    for (rec, arrays), sample in zip(ds.iter_arrays(), generated):
        assert arrays.token_ids.tolist() == sample.output_token_ids
        assert torch.equal(arrays.hidden, sample.generated_rows())
    assert len({tuple(s.output_token_ids) for s in generated}) > 3  # the samples differ
    from uhead_vllm.study.train import open_datasets

    assert len(open_datasets([dataset[0], out])) == 2  # temperature / samples may differ between sets
    with pytest.raises(ValueError, match="temperature > 0"):
        commands.collect(tmp_path / "bad", ["basic_arithmetic:1:0"], model=str(model), layers=LAYERS, samples=2,
                         progress=False, generator=gen)


def test_clear_errors(tiny, tmp_path):
    model, gen, _ = tiny
    with pytest.raises(DatasetError, match="does not exist"):
        StudyDataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="manifest"):
        StudyDataset(tmp_path / "empty")
    with pytest.raises(HeadMismatchError):  # the shipped head belongs to SmolLM2, not the tiny model
        uhead_vllm.answer(["1 + 1?"], None, model=str(model), generator=gen)


def test_default_head_matches_embedded_model(embedded_model, tiny_models):
    config = json.loads((default_head_dir() / "config.json").read_text())
    head = load_head(default_head_dir(), expect_model_identity=model_identity(embedded_model))
    assert head.recipe.layers == config["layers"]
    assert sum(f.stat().st_size for f in default_head_dir().iterdir()) < 5 << 20
    assert (default_head_dir() / "RECIPE.md").is_file()
    with pytest.raises(HeadMismatchError):
        load_head(default_head_dir(), expect_model_identity=model_identity(tiny_models["llama"]))


@pytest.mark.slow
def test_main_job_answers_with_the_default_head(embedded_model, capsys):
    """`uhead-vllm answer` out of the box: embedded model + shipped head, per-step and per-answer."""
    scored = uhead_vllm.answer(["What is 7 + 8?", "Calculate 91 - 17 + 5."], model=str(embedded_model), max_tokens=32)
    gc.collect()
    assert len(scored) == 2
    for s in scored:
        step_probs = [st.uncertainty for st in s.steps if st.uncertainty is not None]
        assert step_probs and all(0.0 <= p <= 1.0 for p in step_probs)
        assert s.uncertainty == pytest.approx(max(step_probs))  # the default head scores answers by max_step
        assert s.steps[0].start == 0 and all(a.end == b.start for a, b in zip(s.steps, s.steps[1:]))
    out = capsys.readouterr().out
    assert out.count("P(wrong) =") == 2


def test_study_draws_calibration_for_the_shipped_default_head():
    """The study's calibration plots are said to be the default head's: the head it names is the
    study head the shipped default was trained as (attention pooling, trained on steps)."""
    import json

    from uhead_vllm.heads import default_head_dir

    name, head_type, level, _, _ = next(h for h in commands.STUDY_HEADS if h[0] == commands.DEFAULT_STUDY_HEAD)
    cfg = json.loads((default_head_dir() / "config.json").read_text())
    assert (head_type, level) == ("attention", cfg["training"]["study"]["level"])
    assert cfg["head_type"].lower().startswith("attention")
