"""Command functions of the study (``collect``, ``train``, ``evaluate``, ``study``) and their
argparse wiring. ``register(subparsers)`` adds them to a CLI; ``python -m uhead_vllm.study`` runs
them directly. The main job (``answer``) is the product's: :mod:`uhead_vllm.scoring.answer`."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

from ..cli_args import add_common_args, add_scaleout_args, scaleout_options
from ..runtime import set_env_defaults, set_threads

if TYPE_CHECKING:  # features imports torch: not at this module's import
    from ..features import Pooling

# ------------------------------------------------------------------------------------------------
# Study defaults (see docs/study.md for why these)
# ------------------------------------------------------------------------------------------------

#: HF hidden-state indices captured for SmolLM2-135M (30 layers), picked by a layer scan with
#: cross-validated linear probes on basic_arithmetic + chain_sum answers
#: (experiments/study/layer_scan.py, numbers in docs/study.md): layers 14-22 score best, more
#: layers add width but no signal at this data size.
DEFAULT_LAYERS = (14, 18, 22)
DEFAULT_TOPK = 10


@dataclass
class StudyPlan:
    """Task plans (``task:n:seed``) of the datasets.

    The head trains on basic_arithmetic only. ``test`` is the held-out split (same task, other
    questions: collected with the train questions excluded). ``heldout`` are tasks the head never
    sees: chain_sum (other wording, one-digit operands: about 45% right, but only ~200 distinct
    questions exist) and chain_sum_3 (three terms, mostly wrong). Seeds are far apart because
    reasoning-gym seeds item i with seed + i.
    """

    train: list[str] = field(default_factory=lambda: ["basic_arithmetic:1000:0"])
    test: list[str] = field(default_factory=lambda: ["basic_arithmetic:550:200000"])
    heldout: dict[str, list[str]] = field(default_factory=lambda: {
        "heldout_chain_sum": ["chain_sum:200:400000"],
        "heldout_chain_sum_3": ["chain_sum_3:300:600000"],
    })

    @classmethod
    def quick(cls) -> "StudyPlan":
        return cls(["basic_arithmetic:150:0"], ["basic_arithmetic:60:200000"],
                   {"heldout_chain_sum": ["chain_sum:40:400000"], "heldout_chain_sum_3": ["chain_sum_3:40:600000"]})


#: The study head shipped as the default head (uhead_vllm/heads/default); calibration plots are drawn for it.
DEFAULT_STUDY_HEAD = "attention_step"

#: Heads the study trains and compares: (name, head type, level, pooling, hyper-parameters).
STUDY_HEADS: tuple[tuple[str, str, str, Pooling, dict[str, Any]], ...] = (
    ("linear_joint", "linear", "joint", "mean", {"C": 0.01}),
    ("attention_step", "attention", "step", "mean", {"max_epochs": 40, "patience": 8}),
    ("attention_joint", "attention", "joint", "mean", {"max_epochs": 40, "patience": 8}),
)


def _progress(args: argparse.Namespace) -> bool:
    return not getattr(args, "no_progress", False)


def _parse_named(items: Sequence[str], what: str) -> dict[str, Path]:
    """``name=path`` pairs (a bare path is named by its folder)."""
    out: dict[str, Path] = {}
    for item in items:
        name, _, path = item.rpartition("=")
        p = Path(path)
        out[name or p.name] = p
    if not out:
        raise SystemExit(f"give at least one {what}")
    return out


# ------------------------------------------------------------------------------------------------
# Plain functions
# ------------------------------------------------------------------------------------------------


def _model_path(model: str | None) -> Path:
    from ..models import resolve_model

    return resolve_model(model)


def collect(out: str | Path, tasks: Sequence[str], *, model: str | None = None,
            layers: Sequence[int] = DEFAULT_LAYERS, style: str = "steps_plain", max_tokens: int = 64,
            temperature: float = 0.0, logprobs: int = DEFAULT_TOPK, split_mode: Literal["line", "sentence"] = "line",
            seed: int = 0, samples: int = 1, exclude_from: Sequence[str | Path] = (), batch_size: int = 64,
            overwrite: bool = False, progress: bool = True, generator: Any = None, ray: Any = None,
            engine: dict[str, Any] | None = None) -> Path:
    """Generate, grade and store answers for ``tasks`` (``task:n:seed`` each) into dataset ``out``.

    ``ray``: a :class:`uhead_vllm.scaleout.RayOptions` to run the units on Ray actors (the dataset is
    identical to a one-process run); ``engine``: vLLM settings replacing the job's defaults
    (:data:`~uhead_vllm.generation.SMALL_CPU_ENGINE`), e.g. ``{"dtype": "bfloat16"}`` on a GPU.
    An interrupted run of the same collection resumes from its finished units."""
    from .collect import GenerationRecipe, collect as run_collect, plan_job
    from .data import StudyDataset

    recipe = GenerationRecipe(style, max_tokens, temperature, logprobs, split_mode, seed, samples)
    exclude = {a.question for d in exclude_from for a in StudyDataset(d).answers}
    path = _model_path(model)
    job = plan_job(out, tasks, path, layers, recipe, exclude=exclude, batch_size=batch_size, engine=engine,
                   about={"model_path_name": path.name, "excluded_from": [str(d) for d in exclude_from]})
    dataset, run = run_collect(job, generator=generator, ray=ray, overwrite=overwrite, progress=progress)
    if ray is not None or run["resumed_units"]:
        _log(f"collect {dataset.name}: {_run_line(run)}")
    return dataset


def _run_line(run: dict[str, Any]) -> str:
    parts = [f"{run['units']} units", f"{run['rows']} rows in {run['seconds']:.1f} s ({run['rows_per_s']:.0f} rows/s)"]
    if run["resumed_units"]:
        parts.append(f"{len(run['resumed_units'])} resumed from an interrupted run")
    if run["executor"] == "ray":
        parts.append(f"{run['replicas']} Ray replicas ({run['actors_replaced']} replaced, "
                     f"{run['units_retried']} units redone)")
    return ", ".join(parts)


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def _generator(path: Path, layers: Sequence[int]) -> Any:
    from ..scoring.recipe import build_job_generator

    return build_job_generator(path, layers)


def train(data: Sequence[str | Path], out: str | Path, *, head: str = "attention", level: str = "joint",
          layers: Sequence[int] | None = None, pooling: Pooling = "mean", logprob_topk: int = DEFAULT_TOPK,
          seed: int = 0, hyper: dict[str, Any] | None = None, threads: int | None = 1,
          progress: bool = True, overwrite: bool = False, examples: Any = None) -> Path:
    """Train a head on dataset directories ``data`` and save it to ``out``."""
    from .train import train_head

    out = Path(out)
    if (out / "config.json").exists() and not overwrite:
        raise FileExistsError(f"{out} already holds a head; pass overwrite=True (--overwrite)")
    set_threads(threads)
    h = train_head(data, head, level, layers, pooling, logprob_topk, seed, hyper, progress, examples)
    h.save(out)
    return out


def evaluate(heads: Mapping[str, str | Path], data: Mapping[str, str | Path], out: str | Path, *,
             threads: int | None = 1, n_boot: int = 1000, progress: bool = True,
             calibration_head: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate heads (``name -> dir``) on datasets (``name -> dir``); writes results into ``out``.
    Calibration plots are drawn for ``calibration_head`` (default: the first head)."""
    from .evaluate import evaluate as run_evaluate

    set_threads(threads)
    return run_evaluate(heads, data, out, n_boot=n_boot, progress=progress, extra=extra,
                        calibration_head=calibration_head)


def _collect_all(out_data: dict[str, Path], plan: StudyPlan, model: str | None, layers: Sequence[int],
                 progress: bool) -> float:
    """Collect the study's datasets with one engine; returns the engine load time."""
    t0 = time.perf_counter()
    gen = _generator(_model_path(model), layers)
    load_s = time.perf_counter() - t0
    common = dict(model=model, layers=layers, overwrite=True, progress=progress, generator=gen)
    collect(out_data["train"], plan.train, **common)
    collect(out_data["test"], plan.test, exclude_from=[out_data["train"]], **common)
    for name, tasks in plan.heldout.items():
        collect(out_data[name], tasks, **common)
    return load_s


def run_study(out: str | Path = "experiments/results/study", *, model: str | None = None,
              layers: Sequence[int] = DEFAULT_LAYERS, plan: StudyPlan | None = None, quick: bool = False,
              threads: int | None = 1, reuse_data: bool = False, n_boot: int = 1000, progress: bool = True,
              collect_only: bool = False, collect_in_subprocess: bool = True) -> dict[str, Any]:
    """collect (train / test / held-out tasks) -> train the study heads -> evaluate; one command.

    Collection runs in a child process by default: an in-process vLLM-CPU engine pins torch's
    thread count (it replaces ``torch.set_num_threads``), while head training is fastest with the
    ``threads`` asked for here.
    """
    t_start = time.perf_counter()
    out = Path(out)
    plan = plan or (StudyPlan.quick() if quick else StudyPlan())
    data = {"train": out / "data" / "train", "test": out / "data" / "test",
            **{name: out / "data" / name for name in plan.heldout}}
    timings: dict[str, float] = {}
    if not (reuse_data and all((d / "manifest.json").is_file() for d in data.values())):
        t0 = time.perf_counter()
        if collect_in_subprocess and not collect_only:
            cmd = [sys.executable, "-m", "uhead_vllm.study", "study", "--out", str(out), "--collect-only",
                   "--plan-json", json.dumps(asdict(plan)), "--layers", *map(str, layers)]
            cmd += ["--model", model] if model else []
            cmd += [] if progress else ["--no-progress"]
            subprocess.run(cmd, check=True)
        else:
            timings["engine_load_s"] = _collect_all(data, plan, model, layers, progress)
        timings["collect_s"] = time.perf_counter() - t0
    if collect_only:
        return {"timings": timings}
    set_threads(threads)
    t0 = time.perf_counter()
    from ..features import FeatureRecipe
    from .data import StudyDataset
    from .examples import load_examples
    from .train import open_datasets

    sets = open_datasets([data["train"]])
    cache: dict[str, Any] = {}
    head_dirs = {}
    for name, head_type, level, pooling, hyper in STUDY_HEADS:
        recipe = FeatureRecipe(sets[0].layers, pooling, DEFAULT_TOPK)
        key = json.dumps(recipe.to_dict(), sort_keys=True)
        if key not in cache:
            cache[key] = load_examples(sets, recipe, progress=progress)
        head_dirs[name] = train([data["train"]], out / "heads" / name, head=head_type, level=level, pooling=pooling,
                                logprob_topk=DEFAULT_TOPK, hyper=hyper, threads=None, progress=progress,
                                overwrite=True, examples=cache[key])
    timings["train_s"] = time.perf_counter() - t0
    del cache
    gc.collect()
    t0 = time.perf_counter()
    extra = {"plan": asdict(plan), "layers": list(layers), "threads": threads,
             "counts": {k: StudyDataset(v).manifest["counts"]["total"] for k, v in data.items()}}
    results = evaluate(head_dirs, {k: v for k, v in data.items() if k != "train"}, out, threads=None,
                       n_boot=n_boot, progress=progress, extra=extra, calibration_head=DEFAULT_STUDY_HEAD)
    timings["evaluate_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    results["timings"] = {k: round(v, 1) for k, v in timings.items()}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    from .evaluate import results_markdown

    (out / "results.md").write_text(results_markdown(results))
    return results


# ------------------------------------------------------------------------------------------------
# argparse wiring
# ------------------------------------------------------------------------------------------------


def _cmd_collect(args: argparse.Namespace) -> None:
    ray, engine = scaleout_options(args)
    path = collect(args.out, args.tasks, model=args.model, layers=args.layers, style=args.style,
                   max_tokens=args.max_tokens, temperature=args.temperature, logprobs=args.logprobs,
                   split_mode=args.split_mode, seed=args.seed, samples=args.samples, exclude_from=args.exclude_from,
                   batch_size=args.batch_size, overwrite=args.overwrite, progress=_progress(args), ray=ray,
                   engine=engine)
    counts = json.loads((path / "manifest.json").read_text())["counts"]["total"]
    print(f"wrote {path}: {counts['answers']} answers ({counts['correct']} correct), {counts['steps']} steps "
          f"({counts['steps_right']} right, {counts['steps_wrong']} wrong, {counts['steps_unlabelled']} unlabelled)")


def _cmd_train(args: argparse.Namespace) -> None:
    hyper = json.loads(args.hyper) if args.hyper else None
    path = train(args.data, args.out, head=args.head, level=args.level, layers=args.layers, pooling=args.pooling,
                 logprob_topk=args.logprob_topk, seed=args.seed, hyper=hyper, threads=args.threads,
                 progress=_progress(args), overwrite=args.overwrite)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"saved head to {path} ({size / 1e6:.2f} MB)")


def _cmd_evaluate(args: argparse.Namespace) -> None:
    results = evaluate(_parse_named(args.head, "--head"), _parse_named(args.data, "--data"), args.out,
                       threads=args.threads, n_boot=args.n_boot, progress=_progress(args))
    print((Path(args.out) / "results.md").read_text())
    print(f"results: {Path(args.out) / 'results.json'}; plots: {', '.join(results['plots'])}")


def _cmd_study(args: argparse.Namespace) -> None:
    plan = StudyPlan(**json.loads(args.plan_json)) if args.plan_json else None
    results = run_study(args.out, model=args.model, layers=args.layers, plan=plan, quick=args.quick,
                        threads=args.threads, reuse_data=args.reuse_data, n_boot=args.n_boot,
                        progress=_progress(args), collect_only=args.collect_only)
    if args.collect_only:
        return
    print((Path(args.out) / "results.md").read_text())
    print(f"timings (s): {results['timings']}")


def register(subparsers: Any) -> None:
    """Add ``collect``, ``train``, ``evaluate`` and ``study`` to an argparse subparsers."""
    from ..heads import head_names

    p = subparsers.add_parser("collect", help="generate labelled answers with hidden states into a dataset folder")
    p.add_argument("--out", required=True, help="dataset directory to write")
    p.add_argument("--tasks", nargs="+", required=True, metavar="TASK:N:SEED",
                   help="e.g. basic_arithmetic:500:0 chain_sum:100:100000, or file:questions.jsonl "
                        "(one {\"question\": ..., \"answer\": ...} per line, graded by the number)")
    p.add_argument("--model", default=None, help="HF folder, or 'default' for the embedded SmolLM2-135M-Instruct")
    p.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS), help="HF hidden-state indices")
    p.add_argument("--style", default="steps_plain", help="prompt style (steps_plain, explain, raw, steps, direct)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--logprobs", type=int, default=DEFAULT_TOPK, help="top-k logprobs stored per token")
    p.add_argument("--split-mode", choices=("line", "sentence"), default="line")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--samples", type=int, default=1, help="answers per question (needs temperature > 0)")
    p.add_argument("--exclude-from", nargs="*", default=[], help="datasets whose questions must not be reused")
    p.add_argument("--batch-size", type=int, default=64,
                   help="questions per vLLM call = per shard = per unit of work (a Ray actor does whole units)")
    p.add_argument("--overwrite", action="store_true", help="replace the dataset (or an interrupted run of another one)")
    add_scaleout_args(p)
    add_common_args(p, threads=False)
    p.set_defaults(func=_cmd_collect)

    p = subparsers.add_parser("train", help="train an uncertainty head on dataset folders")
    p.add_argument("--data", nargs="+", required=True, help="dataset directories")
    p.add_argument("--out", required=True, help="head directory to write (config.json + weights.safetensors)")
    p.add_argument("--head", choices=head_names(), default="attention")
    p.add_argument("--level", choices=("step", "answer", "joint"), default="joint")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="subset of the captured layers")
    p.add_argument("--pooling", choices=("mean", "last", "mean_last"), default="mean")
    p.add_argument("--logprob-topk", type=int, default=DEFAULT_TOPK)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hyper", default=None, help='head hyper-parameters as JSON, e.g. \'{"max_epochs": 40}\'')
    p.add_argument("--overwrite", action="store_true")
    add_common_args(p)
    p.set_defaults(func=_cmd_train)

    p = subparsers.add_parser("evaluate", help="ROC-AUC / PRR / calibration of heads vs logprob baselines")
    p.add_argument("--head", nargs="+", required=True, metavar="NAME=DIR")
    p.add_argument("--data", nargs="+", required=True, metavar="NAME=DIR")
    p.add_argument("--out", required=True, help="directory for results.json, results.md and plots")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples for CIs (0 = none)")
    add_common_args(p)
    p.set_defaults(func=_cmd_evaluate)

    p = subparsers.add_parser("study", help="collect -> train -> evaluate on the embedded model, one command")
    p.add_argument("--out", default="experiments/results/study")
    p.add_argument("--model", default=None)
    p.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS))
    p.add_argument("--quick", action="store_true", help="a few hundred answers: a smoke run, not the study")
    p.add_argument("--reuse-data", action="store_true", help="skip collection when the datasets exist")
    p.add_argument("--collect-only", action="store_true", help="only collect the datasets (used internally)")
    p.add_argument("--plan-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--n-boot", type=int, default=1000)
    add_common_args(p)
    p.set_defaults(func=_cmd_study)


def main(argv: Sequence[str] | None = None) -> None:
    set_env_defaults(quiet=True)
    parser = argparse.ArgumentParser(prog="python -m uhead_vllm.study", description=__doc__)
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)
