"""The value study's parts: ranking head, labelling rule, shared-tree search, statistics.

The search and labelling tests run the real vLLM engine on the tiny Llama; a head's validity on a
candidate is checked against Hugging Face rows of exactly the candidate's tokens in its context.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from conftest import make_vllm_kwargs
from reference import hf_rows
from uhead_vllm.features import FeatureRecipe, pool
from uhead_vllm.heads import RankingProbeHead, load_head, load_head_for_model, ranking_head_dir
from uhead_vllm.heads.ranking import sibling_pairs
from uhead_vllm.study.value.labels import label_candidates
from uhead_vllm.study.value.search import ORACLE, TreeSearch, majority_vote
from uhead_vllm.study.value.stats import paired_bootstrap, step_metrics, within_group_accuracy
from uhead_vllm.study.value.steps import StepData, collect_steps
from uhead_vllm.study.value.tree import Candidate, Expander, Node
from uhead_vllm.tasks import FILE_TASK, Question, extract_answer
from uhead_vllm.thinkbooster.scorers import HeadScorer

LAYERS = (1, 4)


# ------------------------------------------------------------------------------ no engine
def _siblings(n_groups: int = 300, seed: int = 0):
    """Groups of 4 whose difficulty (feature 0) decides most labels across groups, while only
    feature 1 orders siblings: a pointwise probe leans on feature 0, a ranker must use feature 1."""
    rng = np.random.default_rng(seed)
    g = np.repeat(np.arange(n_groups), 4)
    difficulty = np.repeat(rng.normal(size=n_groups), 4)
    within = rng.normal(size=g.size)
    values = 1 / (1 + np.exp(-(4 * difficulty + within)))
    wrong = (values < 0.5).astype(int)
    x = np.stack([difficulty + 0.1 * rng.normal(size=g.size), within, rng.normal(size=g.size)], axis=1)
    return x, wrong, g, values


def test_ranking_head_orders_siblings_better_than_a_pointwise_probe():
    x, wrong, g, values = _siblings()
    xt, wt, gt, vt = _siblings(seed=1)
    recipe = FeatureRecipe([1], pooling="mean")
    ranker = RankingProbeHead(recipe, pair_weight=4.0, l2=1e-2).fit_pooled(x, wrong, g, values)
    pointwise = RankingProbeHead(recipe, pair_weight=0.0, l2=1e-2).fit_pooled(x, wrong, g, values)
    acc = {name: within_group_accuracy(gt, vt, 1 - 1 / (1 + np.exp(-h.decision_pooled(xt))))
           for name, h in (("ranker", ranker), ("pointwise", pointwise))}
    assert acc["ranker"] > 0.94  # measured 0.955; the pointwise probe 0.873
    assert acc["ranker"] > acc["pointwise"] + 0.05
    assert ranker.training_summary_["n_pairs"] > 0
    # the recorded loss is the fitted one, below the loss at zero weights (ln 2 per term)
    assert ranker.training_summary_["final_loss"] < 0.8 * np.log(2) * (1 + 4.0)


def test_shipped_ranking_head_fits_the_embedded_model_and_scores(embedded_model):
    head = load_head_for_model(ranking_head_dir(), embedded_model)
    assert isinstance(head, RankingProbeHead) and list(head.recipe.layers) == [14, 18, 22]
    assert head.usage.level == "step" and head.usage.generation["temperature"] == 0.3
    rng = np.random.default_rng(0)
    steps = [rng.normal(size=(3, head.n_features_in_)).astype(np.float32) for _ in range(5)]
    p = head.predict_proba(steps)
    assert p.shape == (5,) and ((p > 0) & (p < 1)).all() and np.unique(p).size == 5


def test_ranking_head_round_trips_and_scores_steps(tmp_path):
    rng = np.random.default_rng(0)
    steps = [rng.normal(size=(int(rng.integers(1, 5)), 6)).astype(np.float32) for _ in range(40)]
    wrong = np.arange(40) % 2
    head = RankingProbeHead(FeatureRecipe([1], pooling="mean_last"), pair_weight=1.0)
    head.fit(steps, wrong, np.arange(40) // 4, rng.random(40))
    head.save(tmp_path / "h")
    loaded = load_head(tmp_path / "h")
    assert isinstance(loaded, RankingProbeHead) and loaded.n_features_in_ == 6
    np.testing.assert_array_equal(loaded.predict_proba(steps), head.predict_proba(steps))
    p = head.predict_proba(steps)
    assert ((p > 0) & (p < 1)).all()


def test_sibling_pairs_and_within_group_accuracy():
    groups = np.array([0, 0, 0, 1, 1, 2])
    values = np.array([1.0, 0.0, 0.5, 0.0, 0.0, 1.0])
    b, w, gap = sibling_pairs(groups, values)
    assert sorted(zip(b.tolist(), w.tolist(), gap.tolist())) == [(0, 1, 1.0), (0, 2, 0.5), (2, 1, 0.5)]
    assert within_group_accuracy(groups, values, [0.9, 0.1, 0.5, 0.3, 0.3, 0.0]) == 1.0
    assert within_group_accuracy(groups, values, [0.1, 0.9, 0.5, 0.3, 0.3, 0.0]) == 0.0
    assert within_group_accuracy(groups, values, [0.5, 0.5, 0.5, 0, 0, 0]) == 0.5
    m = step_metrics(groups, values, [0.9, 0.1, 0.5, 0.3, 0.3, 0.0])
    assert m["pr_auc_chance"] == pytest.approx(0.5)
    assert step_metrics([0, 0], [0.0, 0.0], [0.2, 0.4])["roc_auc"] is None  # one class: undefined, not 0


def test_paired_bootstrap_interval():
    a = np.r_[np.ones(60), np.zeros(40)]
    b = np.r_[np.ones(40), np.zeros(60)]
    r = paired_bootstrap(a, b, resamples=2000)
    assert r["delta"] == pytest.approx(0.2)
    assert 0.1 < r["lo"] < 0.2 < r["hi"] < 0.3
    same = paired_bootstrap(a, a, resamples=200)
    assert same["lo"] == same["hi"] == 0.0


def test_majority_vote_ignores_answerless_samples():
    answers = [("no idea", 3), ("Answer: 7", 4), ("so 7", 2), ("Answer: 5", 5)]
    text, tokens = majority_vote(answers, extract_answer)
    assert extract_answer(text) == "7" and tokens == 14


# ------------------------------------------------------------------------------ real engine
@pytest.fixture(scope="module")
def tiny(tiny_models):
    from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm

    path = tiny_models["llama"]
    llm = build_llm(str(path), LAYERS, **make_vllm_kwargs(max_model_len=512, max_num_batched_tokens=1024))
    yield path, VllmHiddenStatesGenerator(llm)
    del llm
    gc.collect()


def _questions() -> list[Question]:
    return [Question(FILE_TASK, "a", "What is 2 + 2?", "4", {}), Question(FILE_TASK, "b", "the cat counts", "3", {})]


def _chat(q: Question) -> list[dict]:
    return [{"role": "user", "content": q.question}]


def _head(path, gen) -> HeadScorer:
    """A ranking head on the tiny model's own rows (arbitrary labels: this tests plumbing)."""
    from vllm import SamplingParams

    res = gen.generate(["the cat sees", "12 + 7 ="], SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=0))
    steps = [s.generated_rows().reshape(s.generated_rows().shape[0], -1) for row in res.hidden_states for s in row]
    head = RankingProbeHead(FeatureRecipe(list(LAYERS), pooling="mean_last"))
    head.fit(steps, np.arange(len(steps)) % 2, np.arange(len(steps)) // 4, np.linspace(0, 1, len(steps)))
    return HeadScorer(head)


def _expander(gen, heads, seed=0, feature_head=None) -> Expander:
    return Expander(gen, _questions(), _chat, heads, temperature=1.0, max_step_tokens=6, seed=seed,
                    logprobs=3, feature_head=feature_head)


@pytest.mark.slow
def test_candidates_are_seeded_by_node_and_heads_read_exact_rows(tiny):
    path, gen = tiny
    scorer = _head(path, gen)
    a = _expander(gen, {"h": scorer}, feature_head=scorer)
    b = _expander(gen, {"h": scorer})
    nodes = [Node(0), Node(1), Node(0, "so\n")]
    kids_a = a.expand(nodes, 3)
    kids_b = b.expand(list(reversed(nodes)), 3)[::-1]  # other batch order, other engine history
    assert [[c.text for c in ks] for ks in kids_a] == [[c.text for c in ks] for ks in kids_b]
    assert a.expand(nodes[:1], 3)[0] is kids_a[0]  # expanded once, then reused
    checked = 0
    for node, cands in zip(nodes, kids_a):
        prompt = a.prompt_ids(node)["prompt_token_ids"]
        for c in cands:
            assert set(c.validity) == {"h", *Expander.BASELINES}
            ids = list(c.token_ids)[:-1]  # scored without the last token (newline, EOS or cut)
            ref = hf_rows(path, prompt + ids, LAYERS)[len(prompt):]
            feats = ref.reshape(ref.shape[0], -1)
            want = 1.0 - float(scorer.head.predict_proba([feats.numpy()])[0])
            assert c.validity["h"] == pytest.approx(want, abs=1e-4)
            torch.testing.assert_close(c.features, pool(feats, "mean_last"), atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked == 9


@pytest.mark.slow
def test_labelling_rule(tiny):
    _, gen = tiny
    ex = _expander(gen, {})
    calls = []

    def grader(q, text):
        calls.append(text)
        return text.rstrip().endswith("4") or len(text) % 2 == 0  # a deterministic stand-in checker

    node = Node(0)
    wrong_eq = Candidate("2 + 2 = 5\n", (1,) * 6, False)
    done = Candidate("Answer: 4", (1,) * 3, True)
    open_ = Candidate("Let me add.\n", (1,) * 4, False)
    used = label_candidates(ex, [(node, [wrong_eq, done, open_])], k=3, max_tokens=5, grader=grader)
    assert wrong_eq.value == 0.0  # wrong equation: no rollouts
    assert done.value == 1.0  # finished: the answer itself is graded
    assert open_.value in (0.0, 1 / 3, 2 / 3, 1.0) and used > 0
    assert len(calls) == 1 + 3  # the finished answer and the three rollouts of the open step
    assert all(t.startswith("Let me add.\n") for t in calls[1:])


@pytest.mark.slow
def test_shared_tree_search_and_step_data(tiny):
    _, gen = tiny
    ex = _expander(gen, {})
    ts = TreeSearch(ex, max_steps=2, finish_tokens=4, rollouts=2, rollout_tokens=4)
    scorers = ["entropy", "random", ORACLE]
    out = ts.best_of_n(scorers, 3)
    # Every scorer took, at each step, its best candidate among that node's children.
    for s in scorers:
        for q, text in enumerate(out[s].texts):
            node, charged = Node(q), 0
            for _ in range(2):
                cands = ex.children[(node, 3)]
                charged += sum(c.n_tokens for c in cands)
                best = max(cands, key=lambda c: c.value if s == ORACLE else c.validity[s])
                node = Node(q, node.prefix + best.text)
                if best.finished:
                    break
            assert text.startswith(node.prefix)
            assert out[s].tokens[q] >= charged
    assert all(c.value is not None for (nd, _), cs in ex.children.items() for c in cs
               if any(t.startswith(nd.prefix) for t in out[ORACLE].texts))
    beams = ts.beam_search(["entropy"], 2, 2)
    assert len(beams["entropy"].texts) == 2
    data, info = collect_steps(_expander(gen, {}, seed=3, feature_head=_head(*tiny)), n=2, max_steps=2,
                               rollouts=2, rollout_tokens=4)
    assert len(data.values) % 2 == 0 and len(data.values) >= 4
    assert data.features.shape[0] == len(data.values) and ((data.values >= 0) & (data.values <= 1)).all()
    assert np.bincount(data.groups).tolist() == [2] * len(np.unique(data.groups))


@pytest.mark.slow
def test_search_resumes_from_the_saved_step_tree(tiny, tmp_path):
    """A search cut in the middle of a step and rerun in a fresh process (fresh Expander and
    TreeSearch reading the tree file) ends exactly as one uninterrupted run: same answers, same
    tokens per question, same candidate and rollout tokens charged per part; replayed steps
    generate nothing, and a rerun of finished parts generates nothing at all."""
    from uhead_vllm.study.value.resume import TreeStore

    _, gen = tiny
    scorers = ["entropy", "msp", "random", ORACLE]
    parts = {"bon": lambda ts: ts.best_of_n(scorers, 3), "beam": lambda ts: ts.beam_search(scorers, 2, 2)}

    def search(store=None, cut_at=None, done=()):
        ex = _expander(gen, {}, seed=5)
        ts = TreeSearch(ex, max_steps=3, finish_tokens=4, rollouts=2, rollout_tokens=4, store=store)
        asked, finished, calls, real, finish = [], [], {}, ex._generate, ts._greedy_finish

        def generate(nodes, n):  # the cut_at-th expansion of this process dies, as at a call's time limit
            if sum(calls.values()) == cut_at:
                raise TimeoutError("cut")
            calls[ex.owner] = calls.get(ex.owner, 0) + 1
            asked.extend((nd, n) for nd in nodes)
            real(nodes, n)

        ex._generate = generate
        ts._greedy_finish = lambda nodes: (finished.extend(nodes), finish(nodes))
        pending = set(ex.pending)
        out, charged = {}, {}
        for name, run in parts.items():
            if name not in done:
                ex.owner = name
                before = (ex.generated_tokens, ts.rollout_generated)
                out[name] = {s: (o.texts, o.tokens) for s, o in run(ts).items()}
                charged[name] = (ex.generated_tokens - before[0], ts.rollout_generated - before[1])
        return out, charged, calls, pending, asked, finished, ex

    ref, ref_charged, ref_calls, *_ = search()
    assert ref_calls["bon"] == 3 and ref_calls["beam"] >= 2  # the cuts below fall where they say
    assert all(c > 0 for part in ref_charged.values() for c in part)
    store = TreeStore(tmp_path / "trees" / "t.seed5.json.gz")
    with pytest.raises(TimeoutError):  # best-of-3 steps 1 and 2 generated and saved, step 3 cut
        search(store, cut_at=2)
    assert store.path.is_file() and not list(store.path.parent.glob("*.tmp")) and store.save_s < 5
    out, charged, calls, pending, asked, _, ex = search(TreeStore(store.path))
    assert out == ref and charged == ref_charged
    assert calls == {"bon": 1, "beam": ref_calls["beam"]}  # steps 1 and 2 replayed, not generated
    assert pending and ex.replayed == len(pending) and not pending & set(asked)
    # every part finished and saved: a rerun replays all of it, finishes included, generating nothing
    out, charged, calls, _, asked, finished, ex = search(TreeStore(store.path))
    assert out == ref and charged == ref_charged and calls == {} and asked == finished == []
    # a cut in beam's 2nd step; best-of-3, done before (kept in the unit's .partial), is not rerun
    other = TreeStore(tmp_path / "b.json.gz")
    with pytest.raises(TimeoutError):
        search(other, cut_at=ref_calls["bon"] + 1)
    out, charged, calls, *_ = search(TreeStore(other.path), done=("bon",))
    assert out == {"beam": ref["beam"]} and charged == {"beam": ref_charged["beam"]}
    assert calls == {"beam": ref_calls["beam"] - 1}


def test_step_data_round_trip(tmp_path):
    d = StepData(torch.randn(4, 3), np.array([0, 1, 0.5, 0]), np.array([0, 0, 1, 1]), np.array([0, 0, 1, 1]),
                 np.array([0, 0, 0, 0]), {"entropy": np.array([0.1, 0.2, 0.3, 0.4])}, ["a", "b", "c", "d"])
    d.save(tmp_path / "x.train")
    e = StepData.load(tmp_path / "x.train")
    assert torch.equal(d.features, e.features) and e.texts == d.texts
    np.testing.assert_array_equal(e.validity["entropy"], d.validity["entropy"])
    assert (tmp_path / "x.train.safetensors").is_file()


def test_sharded_search_units_merge_into_the_unsharded_layout(tmp_path):
    """Shards are contiguous slices; their files merge into one unit file in question order, and
    only once every shard is there."""
    import json

    from experiments.value.run_value_study import merge_shards, shard_questions

    qids = [f"q{i}" for i in range(7)]
    slices = [shard_questions(qids, i, 3) for i in range(3)]
    assert [q for s in slices for q in s] == qids and all(slices)
    shards = tmp_path / "search" / "shards"
    shards.mkdir(parents=True)

    def write(i: int) -> None:
        qs = slices[i]
        runs = {"greedy": {"correct": [int(q[1:]) % 2 for q in qs], "tokens": [int(q[1:]) for q in qs]}}
        (shards / f"t.seed0.n8.shard{i}of3.json").write_text(json.dumps(
            {"task": "t", "seed": 0, "n": 8, "questions": qs, "runs": runs, "wall_s": 1.0,
             "candidate_tokens": 10, "oracle_rollout_tokens": 5, "resumed": i == 1}))

    write(2)
    write(0)
    assert merge_shards(tmp_path) == []  # shard 1 missing: no unit file yet
    write(1)
    [unit] = merge_shards(tmp_path)
    d = json.loads(unit.read_text())
    assert unit.name == "t.seed0.n8.json" and d["questions"] == qids and d["shards"] == 3
    assert d["runs"]["greedy"]["tokens"] == list(range(7))
    assert d["runs"]["greedy"]["correct"] == [i % 2 for i in range(7)]
    assert (d["wall_s"], d["candidate_tokens"], d["resumed"]) == (3.0, 30, True)
    assert merge_shards(tmp_path) == []  # written once
