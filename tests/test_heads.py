"""Heads, features and metrics, independent of vLLM (synthetic data, CPU, a few seconds)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from uhead_vllm.features import (
    FeatureRecipe,
    StepSpan,
    clip_span,
    pool,
    split_steps,
    step_token_features,
    token_char_ends,
)
from uhead_vllm.heads import (
    AttentionPoolingHead,
    HeadMismatchError,
    LinearProbeHead,
    load_head,
)
from uhead_vllm.metrics import (
    expected_calibration_error,
    plot_calibration,
    plot_rejection_curves,
    prr,
    rejection_curve,
    roc_auc,
)

# ---------------------------------------------------------------------------------------------
# synthetic data
# ---------------------------------------------------------------------------------------------

HIDDEN, LAYERS = 8, [2, 4]
F = HIDDEN * len(LAYERS)
IDENTITY = {"name": "tiny-llama", "architecture": "LlamaForCausalLM", "hidden_size": HIDDEN, "num_hidden_layers": 4}
RECIPE = FeatureRecipe(layers=LAYERS, pooling="mean")


def make_steps(n: int, seed: int, shift: float = 1.5) -> tuple[list[torch.Tensor], np.ndarray]:
    """Variable-length steps; wrong ones (≈35%) have every token shifted along a fixed direction."""
    direction = torch.randn(F, generator=torch.Generator().manual_seed(1234))
    direction /= direction.norm()
    gen = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=gen) < 0.35).long().numpy()
    steps = []
    for y in labels:
        t = int(torch.randint(4, 21, (1,), generator=gen))
        steps.append(torch.randn(t, F, generator=gen) + float(y) * shift * direction)
    return steps, labels


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a shared 2-core box they spin-wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data():
    return make_steps(300, seed=0), make_steps(200, seed=1)


def small_attention(**kw) -> AttentionPoolingHead:
    params = dict(d_model=32, nhead=4, dim_feedforward=64, max_epochs=40, patience=6, progress=False, seed=0)
    params.update(kw)
    return AttentionPoolingHead(recipe=RECIPE, model_identity=IDENTITY, **params)


@pytest.fixture(scope="module")
def trained(data):
    (xs, ys), _ = data
    linear = LinearProbeHead(recipe=RECIPE, model_identity=IDENTITY).fit(xs, ys)
    attention = small_attention().fit(xs, ys)
    return {"linear": linear, "attention": attention}


# ---------------------------------------------------------------------------------------------
# heads
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "attention"])
def test_head_learns_separable_synthetic(trained, data, kind):
    _, (xt, yt) = data
    head = trained[kind]
    p = head.predict_proba(xt)
    assert p.shape == (len(xt),) and ((p >= 0) & (p <= 1)).all()
    assert roc_auc(yt, p) > 0.97
    np.testing.assert_allclose(head.score(xt), 1.0 - p)


@pytest.mark.parametrize("kind", ["linear", "attention"])
def test_save_load_round_trip_identical(trained, data, kind, tmp_path):
    _, (xt, _) = data
    head = trained[kind]
    head.save(tmp_path / kind)
    assert sorted(p.name for p in (tmp_path / kind).iterdir()) == ["config.json", "weights.safetensors"]
    config = json.loads((tmp_path / kind / "config.json").read_text())
    assert config["layers"] == LAYERS and config["model_identity"] == IDENTITY and config["n_features"] == F
    loaded = type(head).load(tmp_path / kind, expect_model_identity=IDENTITY, expect_layers=LAYERS)
    assert np.array_equal(loaded.predict_proba(xt), head.predict_proba(xt))
    via_dispatch = load_head(tmp_path / kind, IDENTITY, LAYERS)
    assert type(via_dispatch) is type(head)
    assert np.array_equal(via_dispatch.score(xt), head.score(xt))
    assert loaded.get_params() == head.get_params()


def test_load_checks_head_type(trained, tmp_path):
    trained["attention"].save(tmp_path / "a")
    with pytest.raises(HeadMismatchError, match="attention_pooling"):
        LinearProbeHead.load(tmp_path / "a")


@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"name": "other-model"}, r"name='tiny-llama'.*name='other-model'"),
        ({"architecture": "Qwen3ForCausalLM"}, r"LlamaForCausalLM.*Qwen3ForCausalLM"),
        ({"hidden_size": 16}, r"hidden_size=8.*hidden_size=16"),
        ({"num_hidden_layers": 30}, r"num_hidden_layers=4.*num_hidden_layers=30"),
    ],
)
def test_identity_mismatch_raises(trained, tmp_path, change, pattern):
    trained["linear"].save(tmp_path / "h")
    with pytest.raises(HeadMismatchError, match=pattern):
        load_head(tmp_path / "h", expect_model_identity={**IDENTITY, **change})


def test_layers_and_feature_dim_mismatch_raise(trained, tmp_path):
    trained["linear"].save(tmp_path / "h")
    with pytest.raises(HeadMismatchError, match=r"\[2, 4\].*\[2, 5\]"):
        load_head(tmp_path / "h", expect_layers=[2, 5])
    cfg_path = tmp_path / "h" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["n_features"] = F + 3
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(HeadMismatchError, match=str(F + 3)):
        load_head(tmp_path / "h")
    cfg["recipe"] = None  # no recipe to cross-check: the weights' shape still catches it
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(HeadMismatchError, match="shape"):
        load_head(tmp_path / "h")


def test_predict_validates_feature_dim_and_labels(trained):
    with pytest.raises(ValueError, match="features"):
        trained["linear"].predict_proba([torch.zeros(3, F + 1)])
    with pytest.raises(ValueError, match="one class"):
        LinearProbeHead().fit([torch.zeros(2, 4)] * 3, [0, 0, 0])
    with pytest.raises(RuntimeError, match="not fitted"):
        LinearProbeHead().predict_proba([torch.zeros(2, 4)])


def test_attention_head_is_deterministic_and_handles_long_steps(data):
    (xs, ys), _ = data
    kw = dict(max_epochs=3, max_len=8)
    a = small_attention(**kw).fit(xs[:120], ys[:120])
    b = small_attention(**kw).fit(xs[:120], ys[:120])
    long_steps = [torch.randn(50, F), torch.randn(1, F)]
    assert np.array_equal(a.predict_proba(long_steps), b.predict_proba(long_steps))
    assert a.training_summary_["epochs_run"] <= 3 and a.training_summary_["n_val"] > 0


# ---------------------------------------------------------------------------------------------
# features
# ---------------------------------------------------------------------------------------------

PIECES = [b"x", b" =", b" 1", b" +", b" 2", b"\n", b"so", b" x", b" =", b" 3", b".", b"\n", b"\n",
          b"Caf", b"\xc3", b"\xa9", b" ok", b".", b" Done", b"!"]


def byte_decode(ids: list[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_token_char_ends_multibyte():
    text, ends = token_char_ends(range(len(PIECES)), byte_decode)
    assert text == "x = 1 + 2\nso x = 3.\n\nCafé ok. Done!"
    assert ends == sorted(ends) and ends[-1] == len(text)
    assert ends[14] == ends[13] and text[ends[14]:ends[15]] == "é"  # partial byte: zero width


def test_split_steps_line_and_sentence():
    ids = list(range(len(PIECES)))
    assert split_steps(ids, byte_decode, "line") == [StepSpan(0, 6), StepSpan(6, 13), StepSpan(13, 20)]
    assert split_steps(ids, byte_decode, "sentence") == [
        StepSpan(0, 6), StepSpan(6, 13), StepSpan(13, 18), StepSpan(18, 20)]


def test_split_steps_tokenizer_whitespace_and_explicit():
    class Tok:  # HF-like: decode(ids, skip_special_tokens=..., ...)
        vocab = ["\n", "a", "\n", "b", "<eos>"]

        def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
            return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 4))

    # leading newline joins the first step; EOS (zero width) stays with the last one
    assert split_steps([0, 1, 2, 3, 4], Tok()) == [StepSpan(0, 3), StepSpan(3, 5)]
    assert split_steps([0, 2], Tok()) == [StepSpan(0, 2)]
    assert split_steps([], Tok()) == []
    assert split_steps([1, 2, 3], spans=[(0, 2), (2, 3)]) == [StepSpan(0, 2), StepSpan(2, 3)]
    with pytest.raises(ValueError, match="non-overlapping"):
        split_steps([1, 2, 3], spans=[(0, 2), (1, 3)])
    with pytest.raises(ValueError, match="exceeds"):
        split_steps([1, 2, 3], spans=[(0, 4)])


def test_step_token_features_shapes_and_errors():
    prompt_len, n_gen, captured = 5, 7, [0, 4, 8]
    hidden = torch.randn(prompt_len + n_gen - 1, len(captured), 4)  # last token never forwarded
    topk = torch.randn(n_gen, 3)
    recipe = FeatureRecipe(layers=[8, 4], pooling="mean_last", logprob_topk=2)
    feats = step_token_features(hidden, prompt_len, StepSpan(2, 5), recipe, topk, captured)
    assert feats.shape == (3, recipe.token_dim(4)) == (3, 10)
    assert torch.equal(feats[:, :4], hidden[7:10, 2]) and torch.equal(feats[:, 4:8], hidden[7:10, 1])
    assert torch.equal(feats[:, 8:], topk[2:5, :2])
    assert pool(feats, "mean").shape == (10,) and torch.equal(pool(feats, "last"), feats[-1])
    assert pool(feats, "mean_last").shape == (20,)

    with pytest.raises(ValueError, match="empty"):
        step_token_features(hidden, prompt_len, StepSpan(3, 3), recipe, topk, captured)
    with pytest.raises(ValueError, match="clip_span"):
        step_token_features(hidden, prompt_len, StepSpan(5, 7), recipe, topk, captured)
    assert clip_span(StepSpan(5, 7), prompt_len, hidden.shape[0]) == StepSpan(5, 6)
    assert clip_span(StepSpan(6, 7), prompt_len, hidden.shape[0]) is None
    with pytest.raises(ValueError, match=r"\[2\] were not captured"):
        step_token_features(hidden, prompt_len, StepSpan(0, 2), FeatureRecipe(layers=[2, 4]), None, captured)
    with pytest.raises(ValueError, match="topk_logprobs"):
        step_token_features(hidden, prompt_len, StepSpan(0, 2), recipe, None, captured)
    with pytest.raises(ValueError, match="captured_layers"):
        step_token_features(hidden, prompt_len, StepSpan(0, 2), FeatureRecipe(layers=[4]))
    with pytest.raises(ValueError, match="non-empty"):
        pool(torch.zeros(0, 4), "mean")
    assert FeatureRecipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------


def test_roc_auc_known_values():
    y = [0, 0, 1, 1]
    assert roc_auc(y, [0.1, 0.4, 0.35, 0.8]) == pytest.approx(0.75)
    assert roc_auc(y, [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert roc_auc(y, [0.4, 0.3, 0.2, 0.1]) == 0.0
    assert roc_auc(y, [0.5, 0.5, 0.5, 0.5]) == 0.5
    with pytest.raises(ValueError, match="one class"):
        roc_auc([1, 1], [0.2, 0.3])


def test_prr_oracle_random_and_curve():
    rng = np.random.default_rng(0)
    y = (rng.random(20000) < 0.3).astype(int)
    assert prr(y, y) == pytest.approx(1.0)
    assert prr(y, y + 0.01 * rng.random(y.size)) == pytest.approx(1.0)  # any perfect ranking
    assert abs(prr(y, rng.random(y.size))) < 0.03
    assert prr(y, np.zeros(y.size)) == pytest.approx(0.0)  # ties = random tie-breaking
    assert prr(y, 1 - y) < -0.9  # anti-oracle is far worse than random
    x, q = rejection_curve([1, 0, 0, 1], [0.9, 0.1, 0.2, 0.8])
    np.testing.assert_allclose(x, [0, 0.25, 0.5, 0.75])
    np.testing.assert_allclose(q, [0.5, 2 / 3, 1.0, 1.0])
    assert len(rejection_curve([1, 0, 0, 1], [0.9, 0.1, 0.2, 0.8], max_rejection=0.5)[0]) == 2
    with pytest.raises(ValueError, match="one class"):
        prr([0, 0, 0], [0.1, 0.2, 0.3])


def test_ece():
    assert expected_calibration_error([0, 1], [0.0, 1.0]) == 0.0
    assert expected_calibration_error([1, 1], [0.5, 0.5]) == pytest.approx(0.5)
    assert expected_calibration_error([0, 1, 0, 1], [0.45, 0.45, 0.55, 0.55], n_bins=2) == pytest.approx(0.05)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        expected_calibration_error([0, 1], [0.2, 1.5])


def test_plots_draw_the_right_curves(tmp_path, monkeypatch):
    """The plotted data, checked against independent references: scikit-learn's
    ``calibration_curve`` for the reliability diagram, and the rejection curve recomputed by sorting
    (reject the most uncertain first, accuracy of what is kept)."""
    from matplotlib.figure import Figure
    from matplotlib.image import imread
    from sklearn.calibration import calibration_curve

    figures: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k))[1])
    rng = np.random.default_rng(0)
    y = (rng.random(200) < 0.4).astype(int)
    unc = y * 0.5 + rng.random(200) * 0.7
    out = plot_rejection_curves(tmp_path / "rej.png", {"head": (y, unc), "random": (y, rng.random(200))})
    cal = plot_calibration(tmp_path / "cal.png", y, np.clip(unc, 0, 1))
    rej_fig, cal_fig = figures

    lines = {ln.get_label().split(" (")[0]: ln for ln in rej_fig.axes[0].get_lines()}
    order = np.argsort(-unc, kind="stable")
    want = [1.0 - y[order[i:]].mean() for i in range(len(y))]
    np.testing.assert_allclose(lines["head"].get_xdata(), np.arange(len(y)) / len(y))
    np.testing.assert_allclose(lines["head"].get_ydata(), want)
    assert f"PRR={prr(y, unc):.3f}" in lines["head"].get_label()

    prob_true, prob_pred = calibration_curve(y, np.clip(unc, 0, 1), n_bins=10, strategy="uniform")
    (mean_line,) = [ln for ln in cal_fig.axes[0].get_lines() if ln.get_label() == "mean predicted"]
    np.testing.assert_allclose(mean_line.get_xdata(), prob_pred)
    np.testing.assert_allclose(mean_line.get_ydata(), prob_true)
    assert f"ECE={expected_calibration_error(y, np.clip(unc, 0, 1)):.3f}" in cal_fig.axes[0].get_title()
    for path, fig in ((out, rej_fig), (cal, cal_fig)):
        w, h = fig.get_size_inches() * 120
        assert imread(path).shape[:2] == (round(h), round(w))  # a real image of the figure's size


def _sentencepiece_style_tokenizer() -> Any:
    """A BPE with Llama 2's normalizer and decoders ('▁' for spaces, byte fallback, the text's first
    space stripped), trained here on a few lines: the other family of fast-tokenizer decoders."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))])
    tok.train_from_iterator(["the cat sat on the mat. 1 + 1 = 2\n", "Step one: 12*7 = 84.\nStep two: add 3.\n",
                             "  spaces  and\ttabs\n"] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("name", ["llama", "qwen3", "sentencepiece"])
def test_token_char_ends_of_a_fast_tokenizer_equal_decoding_each_prefix(tiny_models, name):
    """The fast path (each token read off a short window, all windows in one call into the
    tokenizer's backend) gives the offsets that decoding each prefix with the tokenizer's own
    ``decode`` gives: multi-byte characters split across tokens, invalid byte runs, special tokens,
    whitespace, random ids, answers longer than the window."""
    import random

    from transformers import AutoTokenizer

    from uhead_vllm.features import _as_decode_fn

    tok = _sentencepiece_style_tokenizer() if name == "sentencepiece" else AutoTokenizer.from_pretrained(tiny_models[name])
    assert tok.backend_tokenizer is not None
    decode = _as_decode_fn(tok)
    rng = random.Random(0)
    texts = ["Café 😀 数学\n\n 1 + 1 = 2.\n  so x=3", "  leading spaces\n\tand tabs \u00e9\u0301",
             "日本語のテキスト。🙂🙃 👩‍👩‍👧\n" * 3, " the cat sat\n on the mat\n\n\n x"]
    cases = [tok.encode(t, add_special_tokens=False) for t in texts]
    cases += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 160))] for _ in range(60)]
    cases.append(cases[0][:5] + [tok.eos_token_id] + cases[1] + [tok.eos_token_id])
    for ids in cases:
        full = decode(ids)
        ends, last = [], 0
        for k in range(1, len(ids) + 1):
            prefix = decode(ids[:k])
            common = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
            last = max(last, common)
            ends.append(last)
        ends[-1] = len(full)
        assert token_char_ends(ids, tok) == (full, ends)


@pytest.mark.parametrize("name", ["llama", "sentencepiece"])
def test_offsets_kept_for_a_growing_answer_equal_a_fresh_split(tiny_models, name):
    """An answer split again as it grows (a running request's, chunk by chunk; a chunk may end
    inside a character) gives, at every size, the offsets and steps of splitting it afresh; an
    answer that is not a continuation starts over."""
    import random

    from transformers import AutoTokenizer

    from uhead_vllm.features import AnswerOffsets

    tok = _sentencepiece_style_tokenizer() if name == "sentencepiece" else AutoTokenizer.from_pretrained(tiny_models[name])
    rng = random.Random(1)
    text = "Step 1: 3 + 4 = 7.\nCafé 😀 数学 then 7 * 2 = 14\n\n  so x=14.\n" * 4
    answers = [tok.encode(text, add_special_tokens=False)]
    answers += [[rng.randrange(len(tok)) for _ in range(90)] for _ in range(6)]
    for ids in answers:
        offsets = AnswerOffsets(tok)
        size = 0
        while size < len(ids):
            size = min(len(ids), size + rng.randrange(1, 6))
            assert offsets.char_ends(ids[:size]) == token_char_ends(ids[:size], tok)
            for mode in ("line", "sentence"):  # each mode keeps its own steps
                assert split_steps(ids[:size], offsets, mode) == split_steps(ids[:size], tok, mode)
        other = list(reversed(ids[:20]))
        assert offsets.char_ends(other) == token_char_ends(other, tok)
