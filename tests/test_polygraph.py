"""lm-polygraph integration: adapter fixes, stat calculators, head estimators, polygraph_eval.

Each adapter fix is tested against lm-polygraph's own ``WhiteboxModelvLLM`` too; those variants are
strict xfails, so this file fails if upstream ever fixes them (then the workaround can go).
Engines: one tiny Llama (capture on layers 2 and 4) and one tiny padded-vocabulary Qwen3, shared
per module; the end-to-end test runs ``polygraph_eval`` itself in a subprocess.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lm_polygraph.model_adapters import WhiteboxModelvLLM
from lm_polygraph.stat_calculators.greedy_probs import GreedyProbsCalculator
from vllm import SamplingParams

from conftest import REPO_ROOT, make_vllm_kwargs
from reference import assert_rows_match
from uhead_vllm import tasks
from uhead_vllm.features import FeatureRecipe
from uhead_vllm.generation import build_llm
from uhead_vllm.heads import HeadMismatchError, LinearProbeHead
from uhead_vllm.models import model_identity
from uhead_vllm.polygraph import (
    DatasetColumnError,
    HeadNotFoundError,
    UHeadClaim,
    UHeadSequence,
    UheadFeaturesCalculator,
    UheadWhiteboxModelvLLM,
    VllmHiddenStatesCalculator,
    check_csv_dataset,
    load_capture_llm,
    upgrade_whitebox,
)
from uhead_vllm.polygraph.training import collect_features

CONFIG_DIR = REPO_ROOT / "configs" / "polygraph"
LLAMA_LAYERS = (2, 4)
MAX_NEW = 12
QUESTIONS = tasks.load_questions("basic_arithmetic", 8, seed=0)
TEXTS = [tasks.build_chat(q)[0]["content"] for q in QUESTIONS]


def stock_xfail(reason: str, raises: Any = None) -> Any:
    return pytest.param(WhiteboxModelvLLM, id="stock", marks=pytest.mark.xfail(strict=True, reason=reason, raises=raises))


OURS = pytest.param(UheadWhiteboxModelvLLM, id="uhead")


def make_adapter(cls: type, llm: Any, sp: SamplingParams, **kwargs: Any) -> Any:
    """Stock or our adapter over ``llm``; our settings only go to ours."""
    if cls is WhiteboxModelvLLM:
        kwargs.pop("system_prompt", None)
        kwargs.pop("enable_thinking", None)
    return cls(llm, sp, device="cpu", **kwargs)


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def llama_llm(tiny_models):
    llm = build_llm(str(tiny_models["llama"]), LLAMA_LAYERS, **make_vllm_kwargs(max_num_seqs=8))
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def padded_llm(tiny_models):
    llm = build_llm(str(tiny_models["qwen3_padded_vocab"]), (1, 3), **make_vllm_kwargs(max_num_seqs=4))
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def llama_adapter(llama_llm):
    return UheadWhiteboxModelvLLM(llama_llm, SamplingParams(max_tokens=MAX_NEW, logprobs=5), instruct=True, system_prompt=None)


@pytest.fixture(scope="module")
def batch_stats(llama_adapter, tiny_models):
    """Stats of one batch through both calculators, as polygraph_eval would compute them."""
    recipe = FeatureRecipe(layers=list(LLAMA_LAYERS))
    stats = VllmHiddenStatesCalculator()({}, TEXTS[:4], llama_adapter, MAX_NEW)
    stats.update(UheadFeaturesCalculator(recipe)(stats, TEXTS[:4], llama_adapter, MAX_NEW))
    return stats


@pytest.fixture(scope="module")
def llama_head_dir(llama_adapter, tiny_models, tmp_path_factory):
    """A linear probe on the tiny Llama's answer features; labels are arbitrary but both classes."""
    recipe = FeatureRecipe(layers=list(LLAMA_LAYERS), pooling="mean")
    col = collect_features(llama_adapter, TEXTS, recipe, MAX_NEW, batch_size=8)
    labels = np.arange(len(TEXTS)) % 2
    head = LinearProbeHead(recipe=recipe, model_identity=model_identity(tiny_models["llama"]), C=0.1)
    return head.fit(col.sequence_features, labels).save(tmp_path_factory.mktemp("head") / "llama")


class _Stop(Exception):
    """Raised by RecordingLLM after a call: the test only looks at what reached vLLM."""


class RecordingLLM:
    """Forwards to a vllm.LLM, records the RequestOutputs of ``generate`` / ``chat``, then stops."""

    def __init__(self, llm: Any):
        self._llm = llm
        self.outputs: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.outputs = self._llm.generate(*args, **kwargs)
        raise _Stop

    def chat(self, *args: Any, **kwargs: Any) -> Any:
        self.outputs = self._llm.chat(*args, **kwargs)
        raise _Stop


# ------------------------------------------------------------------------------ adapter fixes


@pytest.mark.slow
@pytest.mark.parametrize("cls", [stock_xfail("dense rows are narrower than vLLM's ids", IndexError), OURS])
def test_dense_logprob_rows_cover_padded_vocabulary(cls, padded_llm):
    sp = SamplingParams(max_tokens=6, logprobs=20, temperature=0.0)
    outputs = padded_llm.generate(TEXTS[:2], sp, use_tqdm=False)
    tok_len = len(padded_llm.get_tokenizer())
    ids = {i for ro in outputs for entry in ro.outputs[0].logprobs for i in entry}
    assert max(ids) >= tok_len, "precondition: vLLM returned an id past the tokenizer's range"
    model = make_adapter(cls, padded_llm, SamplingParams(max_tokens=6, logprobs=20))
    out = model.post_processing(outputs)
    vocab = padded_llm.model_config.get_vocab_size()
    assert vocab > tok_len and all(row.shape[1] == vocab for row in out.logits)
    for ro, dense in zip(outputs, out.logits):
        for t, entry in enumerate(ro.outputs[0].logprobs):
            for i, lp in entry.items():
                assert dense[t, i].item() == pytest.approx(lp.logprob)
            assert torch.isinf(dense[t]).sum() == dense.shape[1] - len(entry)


def _rendered_prompt(model: Any, recorder: RecordingLLM) -> str:
    batch = model.tokenize(["What is 2 + 3?"])
    with pytest.raises(_Stop):
        model.generate(input_ids=batch["input_ids"], max_new_tokens=2)
    return model.tokenizer.decode(recorder.outputs[0].prompt_token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [stock_xfail("no chat_template_kwargs: thinking stays on", AssertionError), OURS])
def test_instruct_chat_disables_thinking_by_default(cls, padded_llm):
    recorder = RecordingLLM(padded_llm)
    model = make_adapter(cls, recorder, SamplingParams(max_tokens=2, logprobs=1), instruct=True)
    assert "<think>\n\n</think>" in _rendered_prompt(model, recorder)


@pytest.mark.slow
def test_enable_thinking_is_configurable(padded_llm):
    recorder = RecordingLLM(padded_llm)
    model = UheadWhiteboxModelvLLM(recorder, SamplingParams(max_tokens=2, logprobs=1), instruct=True,
                                   enable_thinking=True, system_prompt="Be brief.")
    prompt = _rendered_prompt(model, recorder)
    assert "<think>" not in prompt and prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    with pytest.raises(TypeError, match="enable_thinking"):
        upgrade_whitebox(model, enable_thinking="no")


def _stock_greedy(model: Any, texts: list[str]) -> dict[str, Any]:
    # As polygraph_eval configures it for vLLM: no attentions, no hidden states.
    return GreedyProbsCalculator(output_attentions=False, output_hidden_states=False)({}, texts, model, MAX_NEW)


def _our_greedy(model: Any, texts: list[str]) -> dict[str, Any]:
    return VllmHiddenStatesCalculator()({}, texts, model, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize(
    "cls, calc",
    [
        pytest.param(WhiteboxModelvLLM, _stock_greedy, id="stock",
                     marks=pytest.mark.xfail(strict=True, reason="samples at temperature 1 / narrow rows / -inf padding")),
        pytest.param(UheadWhiteboxModelvLLM, _our_greedy, id="uhead"),
    ],
)
def test_greedy_stats_match_vllm_greedy_decoding(cls, calc, llama_llm):
    # Plain prompts (no chat), so both adapters send vLLM exactly these texts; reference: vLLM greedy.
    ref = llama_llm.generate(TEXTS[:4], SamplingParams(max_tokens=MAX_NEW, logprobs=5, temperature=0.0), use_tqdm=False)
    model = make_adapter(cls, llama_llm, SamplingParams(max_tokens=MAX_NEW, logprobs=5))
    stats = calc(model, TEXTS[:4])
    assert model.model_type == "vLLMCausalLM"
    assert "attention_all" not in stats and "embeddings_decoder" not in stats
    vocab = max(llama_llm.model_config.get_vocab_size(), len(llama_llm.get_tokenizer()))
    for ro, tokens, ll, rows in zip(ref, stats["greedy_tokens"], stats["greedy_log_likelihoods"], stats["greedy_log_probs"]):
        c = ro.outputs[0]
        assert list(tokens) == list(c.token_ids)
        assert rows.shape == (len(c.token_ids), vocab)
        assert np.allclose(ll, [c.logprobs[t][tok].logprob for t, tok in enumerate(c.token_ids)], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [stock_xfail("texts passed positionally: generate() needs input_ids"), OURS])
def test_generate_texts_returns_n_samples_per_prompt(cls, llama_llm):
    model = make_adapter(cls, llama_llm, SamplingParams(max_tokens=4, logprobs=1), instruct=True, system_prompt=None)
    texts = model.generate_texts(TEXTS[:2], max_new_tokens=4, do_sample=True, num_return_sequences=3)
    assert len(texts) == 6 and all(isinstance(t, str) for t in texts)
    # Values: greedy texts are vLLM's own greedy chat answers to the same user turns (the reference
    # goes to vLLM directly, not through the adapter).
    greedy = model.generate_texts(TEXTS[:2], max_new_tokens=4, do_sample=False, num_return_sequences=1)
    ref = llama_llm.chat([[{"role": "user", "content": t}] for t in TEXTS[:2]],
                         SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False,
                         chat_template_kwargs={"enable_thinking": False})
    assert greedy == [ro.outputs[0].text for ro in ref]


@pytest.mark.slow
def test_upgrade_converts_polygraph_instance_in_place(llama_llm):
    stock = WhiteboxModelvLLM(llama_llm, SamplingParams(max_tokens=4, logprobs=2), device="cpu", instruct=True)
    same = upgrade_whitebox(stock, enable_thinking=False, system_prompt=None)
    assert same is stock and isinstance(stock, UheadWhiteboxModelvLLM)
    assert stock.instruct and stock.system_prompt is None and stock.vocab_size >= len(stock.tokenizer)
    with pytest.raises(TypeError, match="WhiteboxModelvLLM"):
        upgrade_whitebox(object())


# ----------------------------------------------------------------------------- calculators


@pytest.mark.slow
def test_hidden_states_are_exact_and_cover_every_generated_token(batch_stats, tiny_models):
    for hs, tokens in zip(batch_stats["uhead_hidden_states"], batch_stats["greedy_tokens"]):
        assert hs.output_token_ids == tokens
        # the generated window (what the head reads), with the last token's row (compute_last_token)
        assert hs.first_row == hs.prompt_len and hs.hidden.shape[0] == len(hs.output_token_ids)
        assert_rows_match(tiny_models["llama"], hs.token_ids, hs.hidden, LLAMA_LAYERS, tol=1e-4, first_row=hs.first_row)
    assert batch_stats["uhead_model_identity"] == model_identity(tiny_models["llama"])
    assert all(t.shape == (len(tok), 5) for t, tok in zip(batch_stats["uhead_topk_logprobs"], batch_stats["greedy_tokens"]))


@pytest.mark.slow
def test_claims_and_features_line_up_with_tokens(batch_stats, llama_adapter):
    special = set(llama_adapter.tokenizer.all_special_ids)
    for hs, claims, feats, seq in zip(batch_stats["uhead_hidden_states"], batch_stats["claims"],
                                      batch_stats["uhead_claim_features"], batch_stats["uhead_sequence_features"]):
        n = len(hs.output_token_ids)
        while n > 0 and hs.output_token_ids[n - 1] in special:  # trailing EOS is not part of the answer
            n -= 1
        answer = list(range(n or len(hs.output_token_ids)))
        assert [i for c in claims for i in c.aligned_token_ids] == answer
        assert seq.shape == (len(answer), 2 * 128)
        expected = hs.generated_rows()[answer[0] : answer[-1] + 1].reshape(len(answer), -1)
        assert torch.equal(seq, expected)
        for c, f in zip(claims, feats):
            assert torch.equal(f, seq[c.aligned_token_ids[0] : c.aligned_token_ids[-1] + 1])


@pytest.mark.slow
def test_head_estimators_apply_the_saved_head(batch_stats, llama_head_dir, llama_adapter):
    """Reference by hand, from the saved arrays and the raw hidden rows (neither the head's code
    nor the features calculator): P(wrong) = sigmoid(((mean of the span's rows) - mean) / scale
    . coef + intercept)."""
    from safetensors.torch import load_file

    w = {k: v.double() for k, v in load_file(str(llama_head_dir / "weights.safetensors")).items()}

    def by_hand(hs, a: int, b: int) -> float:
        rows = hs.generated_rows()[a:b].reshape(b - a, -1).double()
        z = ((rows.mean(dim=0) - w["scaler_mean"]) / w["scaler_scale"]) @ w["coef"] + w["intercept"][0]
        return float(torch.sigmoid(z))

    special = set(llama_adapter.tokenizer.all_special_ids)
    want_seq, want_claims = [], []
    for hs, claims in zip(batch_stats["uhead_hidden_states"], batch_stats["claims"]):
        n = len(hs.output_token_ids)
        while n > 0 and hs.output_token_ids[n - 1] in special:
            n -= 1
        want_seq.append(by_hand(hs, 0, n or len(hs.output_token_ids)))
        want_claims.append([by_hand(hs, c.aligned_token_ids[0], c.aligned_token_ids[-1] + 1) for c in claims])
    seq = UHeadSequence(llama_head_dir)
    assert seq.reduce == "whole" and str(seq) == "UHead"
    assert np.allclose(seq(batch_stats), want_seq, atol=1e-6)
    per_claim = UHeadClaim(llama_head_dir)(batch_stats)
    assert len(per_claim) == len(want_claims)
    for got, want in zip(per_claim, want_claims):
        assert np.allclose(got, want, atol=1e-6)
    worst = UHeadSequence(llama_head_dir, reduce="max", name="UHeadMax")(batch_stats)
    assert np.allclose(worst, [max(x) for x in want_claims], atol=1e-6)
    assert len(set(np.round(want_seq, 6))) > 1  # the reference is not a constant


# ---------------------------------------------------------------------------------- errors


def test_missing_head_is_a_clear_error(tmp_path):
    with pytest.raises(HeadNotFoundError, match="no saved uncertainty head .*missing config.json"):
        UHeadSequence(tmp_path / "nowhere")
    with pytest.raises(HeadNotFoundError, match="uhead.head_path"):
        load_capture_llm("default", 4, 1, head_path=tmp_path / "nowhere")


@pytest.mark.slow
def test_head_for_another_model_is_refused(batch_stats, llama_head_dir, padded_llm):
    import estimators.uhead_features as builder

    other = UheadWhiteboxModelvLLM(padded_llm, SamplingParams(max_tokens=2, logprobs=1))
    env = type("Env", (), {"model": other})()
    with pytest.raises(HeadMismatchError, match="does not fit the served model"):
        builder.load_stat_calculator({"head_path": str(llama_head_dir)}, env)
    wrong = dict(batch_stats, uhead_model_identity=model_identity(Path(other.model_path)))
    with pytest.raises(HeadMismatchError, match="does not fit the served model"):
        UHeadSequence(llama_head_dir)(wrong)
    other_recipe = dict(batch_stats, uhead_feature_recipe=FeatureRecipe(layers=[4]).to_dict())
    with pytest.raises(HeadMismatchError, match="trained with features"):
        UHeadSequence(llama_head_dir)(other_recipe)


def test_dataset_problems_are_clear_errors(tmp_path):
    csv = tmp_path / "q.csv"
    tasks.write_polygraph_dataset(csv, QUESTIONS[:2])
    assert check_csv_dataset(csv, "question", "answer") == ["question", "answer"]
    with pytest.raises(DatasetColumnError, match="text_column='prompt' is not a column of .*\\['question', 'answer'\\]"):
        check_csv_dataset(csv, "prompt", "answer")
    with pytest.raises(DatasetColumnError, match="label_column='target'"):
        load_capture_llm("default", 4, 1, capture_layers=[1],
                         check_dataset={"path": str(csv), "text_column": "question", "label_column": "target"})
    with pytest.raises(FileNotFoundError, match="write_polygraph_dataset"):
        check_csv_dataset(tmp_path / "missing.csv", "question")


# --------------------------------------------------------------------------- configs, e2e


def _compose(*overrides: str) -> Any:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("polygraph_eval_arith", overrides=list(overrides))


def test_configs_declare_what_the_calculators_provide():
    cfg = _compose()
    by_name = {sc.name: sc for sc in cfg.stat_calculators if sc != "auto"}
    for cls in (VllmHiddenStatesCalculator, UheadFeaturesCalculator):
        stats, deps = cls.meta_info()
        assert list(by_name[cls.__name__].stats) == stats and list(by_name[cls.__name__].dependencies) == deps
    assert cfg.stat_calculators[0] == "auto"  # ours come later, so they provide the greedy stats
    assert cfg.prompt.format(text=QUESTIONS[0].question) == tasks.build_chat(QUESTIONS[0])[0]["content"]
    assert cfg.model.adapter.enable_thinking is False and cfg.uhead.head_path == "default"


@pytest.mark.slow
def test_polygraph_eval_end_to_end(tiny_models, llama_head_dir, tmp_path):
    """polygraph_eval itself, unmodified, on the project's config reduced to a tiny model."""
    csv = tmp_path / "arith.csv"
    tasks.write_polygraph_dataset(csv, QUESTIONS)
    run_dir = tmp_path / "run"
    env = dict(os.environ, HYDRA_CONFIG=str(CONFIG_DIR / "polygraph_eval_arith.yaml"), HYDRA_FULL_ERROR="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))  # estimators/
    env.setdefault("OMP_NUM_THREADS", "1")  # see experiments/polygraph/run_polygraph.py: shared cores
    cmd = [str(Path(sys.executable).parent / "polygraph_eval"), "profile=cpu_tiny", f"model.path={tiny_models['llama']}",
           f"uhead.head_path={llama_head_dir}", f"dataset={csv}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    log = (run_dir / "polygraph_eval.log").read_text()
    for est in ("MaximumSequenceProbability", "Perplexity", "MeanTokenEntropy", "OutputLength", "UHead"):
        for metric in ("prr", "prr_0.5", "isotonic-pcc", "ece"):
            assert f"('sequence', '{est}', 'Accuracy', '{metric}')" in log, (est, metric)
    assert "('claim', 'UHeadClaim'):" in log
    assert "FAILED ESTIMATORS" not in log

    # Values, not only names: each sample's Accuracy is the final number of its greedy answer vs the
    # reference (graded here with tasks.extract_answer, not polygraph's processing); the table's PRR
    # values are lm-polygraph's PredictionRejectionArea over the per-sample values in the same log;
    # the head's P(wrong) lies in [0, 1] (its values are checked by hand in
    # test_head_estimators_apply_the_saved_head).
    from lm_polygraph.ue_metrics import PredictionRejectionArea

    from experiments.polygraph.run_polygraph import parse_log

    parsed = parse_log(run_dir / "polygraph_eval.log")
    acc = np.array(parsed["values"][("sequence", "Accuracy")])
    texts = parsed["greedy_texts"]
    assert len(acc) == len(texts) == len(QUESTIONS)
    want_acc = [float(tasks.extract_answer(t) == tasks.normalize_number(q.answer)) for q, t in zip(QUESTIONS, texts)]
    np.testing.assert_array_equal(acc, want_acc)
    for est in ("MaximumSequenceProbability", "Perplexity", "MeanTokenEntropy", "OutputLength", "UHead"):
        u = np.array(parsed["values"][("sequence", est)])
        assert u.shape == acc.shape and np.isfinite(u).all(), est
        for rej, name in ((1.0, "prr"), (0.5, "prr_0.5")):
            assert parsed["metrics"][("sequence", est, "Accuracy", name)] == pytest.approx(
                PredictionRejectionArea(rej)(u, acc), abs=1e-9), (est, name)
    uhead = np.array(parsed["values"][("sequence", "UHead")])
    assert ((uhead >= 0) & (uhead <= 1)).all()
