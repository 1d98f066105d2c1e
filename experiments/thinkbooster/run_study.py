"""Study: do uncertainty heads make thinkbooster's step strategies answer better?

Runs thinkbooster's own strategies (online best-of-n, beam search) on held-out reasoning-gym
questions through :class:`uhead_vllm.thinkbooster.UHeadVLLMModel`, with the step scorer swapped
between the uncertainty head, a logprob baseline and random choice, plus greedy decoding; grades
every final trajectory with the task's checker and writes a results table.

    .venv/bin/python experiments/thinkbooster/run_study.py            # full study (configs/thinkbooster/study.yaml)
    .venv/bin/python experiments/thinkbooster/run_study.py only=[greedy,bon_head] n_questions=40
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from uhead_vllm.runtime import set_env_defaults  # noqa: E402  (does not import vLLM)

# Sleeping (not spinning) OpenMP workers: on a shared or oversubscribed CPU, spinning threads
# slowed vLLM ~9x here (10 vs 88 tok/s measured with other jobs running).
set_env_defaults(OMP_WAIT_POLICY="PASSIVE")

import logging  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from experiments.thinkbooster.heldout import chat_builder, heldout_questions  # noqa: E402
from experiments.thinkbooster.report import summarize, write_report  # noqa: E402

log = logging.getLogger("thinkbooster_study")


def _quiet_thinkbooster() -> None:
    """thinkbooster logs every candidate at INFO; keep warnings only."""
    for name in ("thinkbooster", "vllm"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _repo_path(p: str) -> Path:
    path = Path(p).expanduser()
    return path if path.is_absolute() else REPO / path


def run_one(name: str, run: DictConfig, cfg: DictConfig, gen: Any, head: Any, questions: list, chat: Any) -> dict:
    """One strategy over all questions; per-question records plus timings."""
    from uhead_vllm.tasks import grade
    from uhead_vllm.thinkbooster import UHeadVLLMModel, make_scorer
    from uhead_vllm.thinkbooster.strategies import make_step_generator, make_strategy

    g = cfg.generation
    model = UHeadVLLMModel(gen, make_scorer(run.scorer, head, cfg.seed), keep_stop_strings=True)
    step_gen = make_step_generator(
        model, temperature=run.temperature, top_p=g.top_p, top_k=g.top_k, min_step_tokens=g.min_step_tokens,
        max_step_tokens=g.max_step_tokens, max_new_tokens=g.max_new_tokens,
        max_context_budget=cfg.engine.max_model_len, markers=list(g.markers), seed=cfg.seed)
    strategy = make_strategy(
        run.strategy, step_gen, candidates_per_step=run.get("candidates_per_step", 1), max_steps=g.max_steps,
        beam_size=run.get("beam_size", 2), candidates_per_beam=run.get("candidates_per_beam", 2),
        aggregation=run.get("aggregation", "min"), prompt_buffer=g.prompt_buffer)
    tok = model.get_tokenizer()
    model.reset_hs_step_cache()  # what newer thinkbooster strategies do before a multi-step loop
    stats_before = _stats(gen)
    start = time.perf_counter()
    records = []
    for lo in range(0, len(questions), cfg.batch_questions):
        batch = questions[lo : lo + cfg.batch_questions]
        results = strategy.generate_trajectories_batch([chat(q) for q in batch])
        for q, r in zip(batch, results):
            text = r["trajectory"]
            correct, score = grade(q, text)
            steps = r["steps"]
            records.append({
                "qid": q.qid, "question": q.question, "answer": q.answer, "trajectory": text,
                "correct": bool(correct), "score": float(score),
                "tokens_generated": int(r["token_stats"]["output_tokens"]),
                "trajectory_tokens": len(tok.encode(text, add_special_tokens=False)),
                "steps": len(steps),
                "validity_scores": [None if v is None else float(v) for v in r["validity_scores"]],
                "candidates": [[{"text": c["text"], "score": c["score"], "selected": c["selected"]}
                                for c in h["candidates"]] for h in r.get("step_candidates", [])],
            })
        log.info("%s: %d/%d questions, accuracy so far %.3f", name, len(records), len(questions),
                 sum(x["correct"] for x in records) / len(records))
    wall = time.perf_counter() - start
    capture = {k: v - stats_before[k] for k, v in _stats(gen).items()}
    return {"name": name, "config": OmegaConf.to_container(run, resolve=True), "records": records,
            "wall_s": wall, "generate_s": model.timings.generate_s, "score_s": model.timings.score_s,
            "score_calls": model.timings.score_calls, "capture": capture}


def _stats(gen: Any) -> dict[str, int]:
    from dataclasses import asdict

    return dict(asdict(gen.stats))


@hydra.main(version_base=None, config_path="../../configs/thinkbooster", config_name="study")
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    _quiet_thinkbooster()
    from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm
    from uhead_vllm.models import model_identity, resolve_model
    from uhead_vllm.thinkbooster import default_head_dir, load_step_head

    names = list(cfg.runs) if cfg.only is None else list(cfg.only)
    unknown = [n for n in names if n not in cfg.runs]
    if unknown:
        raise ValueError(f"unknown runs {unknown}; configured: {list(cfg.runs)}")
    model_path = resolve_model(cfg.model, cache_dir=_repo_path(cfg.model_cache_dir) if cfg.model_cache_dir else None)
    head_dir = _repo_path(cfg.head_dir) if cfg.head_dir else default_head_dir()
    head = load_step_head(head_dir, model_path)
    layers = list(head.recipe.layers)
    questions, heldout = heldout_questions(cfg.task, cfg.n_questions, cfg.question_seed, head)
    chat, style = chat_builder(head, cfg.prompt_style)
    log.info("model %s, head %s (layers %s), %d %s questions (seed %d, %d training questions excluded), "
             "prompt style %s", model_path, head_dir, layers, len(questions), cfg.task, cfg.question_seed,
             heldout["excluded_training_questions"], style)

    start = time.perf_counter()
    e = cfg.engine
    llm = build_llm(str(model_path), layers, dtype=e.dtype, enforce_eager=e.enforce_eager, block_size=e.block_size,
                    kv_cache_memory_bytes=e.kv_cache_memory_bytes, max_model_len=e.max_model_len,
                    max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                    enable_chunked_prefill=e.enable_chunked_prefill,
                    enable_prefix_caching=True, seed=cfg.seed)
    gen = VllmHiddenStatesGenerator(llm)
    load_s = time.perf_counter() - start

    runs = []
    for name in names:
        log.info("run %s: %s", name, OmegaConf.to_container(cfg.runs[name]))
        runs.append(run_one(name, cfg.runs[name], cfg, gen, head, questions, chat))
        log.info("%s done in %.1f s: accuracy %.3f", name, runs[-1]["wall_s"],
                 sum(r["correct"] for r in runs[-1]["records"]) / len(questions))

    meta = {
        "command": "python experiments/thinkbooster/run_study.py " + " ".join(sys.argv[1:]),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "model": str(model_path), "model_identity": model_identity(model_path),
        "head_dir": str(head_dir), "head": {"type": head.head_type, "recipe": head.recipe.to_dict(),
                                            "training": dict(getattr(head, "training_summary_", {}))},
        "prompt_style": style, "heldout": heldout, "question_ids": [q.qid for q in questions],
        "engine_load_s": load_s, "platform": platform.platform(), "cpu_count": os.cpu_count(),
    }
    out_dir = _repo_path(cfg.output_dir)
    summary = summarize(runs)
    paths = write_report(out_dir, cfg.name, meta, runs, summary)
    print(Path(paths["md"]).read_text())
    log.info("wrote %s", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
