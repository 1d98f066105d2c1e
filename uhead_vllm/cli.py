"""The ``uhead-vllm`` command line.

``prepare-model`` converts the embedded model once; ``generate`` runs vLLM with capture on the
embedded (or any local) model and prints answers with a summary of the captured hidden states;
``answer`` is the main job (:func:`uhead_vllm.answer`); ``serve`` starts vLLM's OpenAI server with
per-step uncertainty; the study subcommands (collect, train, evaluate, study) come from
``uhead_vllm.study``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Sequence

from .cli_args import add_common_args, add_scaleout_args, scaleout_options
from .errors import UheadError
from .runtime import set_env_defaults
from .scoring.prompts import EXAMPLE_QUESTIONS


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="local Hugging Face model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model-cache", default=None,
                   help="where the embedded model is converted to (default: $UHEAD_VLLM_MODEL_CACHE "
                        "or ~/.cache/uhead_vllm/models)")


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from .models import model_identity, resolve_model

    path = resolve_model(args.model, args.model_cache)
    ident = model_identity(path)
    print(f"{path}\n{ident['name']}: {ident['architecture']}, {ident['num_hidden_layers']} layers, "
          f"hidden {ident['hidden_size']}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    set_env_defaults()
    from vllm import SamplingParams

    from .generation import VllmHiddenStatesGenerator, build_llm
    from .models import model_identity, resolve_model

    path = resolve_model(args.model, args.model_cache)
    n_layers = model_identity(path)["num_hidden_layers"]
    layers = args.layers or [0, n_layers // 2, n_layers]
    llm = build_llm(str(path), layers, enforce_eager=not args.compiled,
                    kv_cache_memory_bytes=args.kv_cache_mib << 20, max_model_len=2048, seed=args.seed)
    gen = VllmHiddenStatesGenerator(llm, progress=True)
    questions = args.question or EXAMPLE_QUESTIONS
    chats = [[{"role": "user", "content": q}] for q in questions]
    res = gen.generate(chats, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    for q, per in zip(questions, res.hidden_states):
        s = per[0]
        print(f"Q: {q}\nA: {s.text.strip()}\n   hidden states {tuple(s.hidden.shape)} "
              f"(rows x layers {list(s.layers)} x hidden) for {len(s.token_ids)} tokens\n")
    print(f"stats: {res.stats}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uhead-vllm", description="Exact hidden-state capture in vLLM and per-step uncertainty from heads.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare-model", help="convert/verify the embedded model and print its path")
    add_model_args(p)
    p.set_defaults(func=cmd_prepare_model)

    p = sub.add_parser("generate", help="answer questions with vLLM and capture hidden states")
    add_model_args(p)
    p.add_argument("question", nargs="*", help="questions (default: a few built-in arithmetic ones)")
    p.add_argument("--layers", type=int, nargs="+", help="HF hidden-state indices (default: 0, middle, last)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--compiled", action="store_true", help="compiled mode (slower start, faster decode)")
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", allow_abbrev=False, help="vLLM's OpenAI-compatible server with per-step uncertainty "
                       "(other flags go to vLLM's serve parser)")
    from .serving.launch import add_serve_args

    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    from .study.commands import register

    register(sub)

    p = sub.add_parser("answer", help="answer questions with per-step and per-answer uncertainty")
    p.add_argument("questions", nargs="*", help="questions, quoted (default: a few built-in arithmetic ones)")
    p.add_argument("--file", default=None, help="a text file with one question per line")
    p.add_argument("--head", default=None, help="head directory (default: the shipped default head)")
    p.add_argument("--model", default=None, help="must be the model the head was trained on")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--allow-other-weights", action="store_true",
                   help="accept a head trained on other weights of this model shape (fingerprint mismatch)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="questions per vLLM call (default: all at once; 64 with --ray)")
    add_scaleout_args(p)
    add_common_args(p)
    p.set_defaults(func=cmd_answer)
    return parser


def cmd_answer(args: argparse.Namespace) -> int:
    from .scoring.answer import answer

    questions = list(args.questions)
    if args.file:
        from pathlib import Path

        questions += [line.strip() for line in Path(args.file).read_text().splitlines() if line.strip()]
    ray, engine = scaleout_options(args)
    answer(questions or list(EXAMPLE_QUESTIONS), args.head, model=args.model, max_tokens=args.max_tokens,
           threads=args.threads, as_json=args.json, allow_other_weights=args.allow_other_weights,
           batch_size=args.batch_size, ray=ray, engine=engine)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .serving.launch import run

    return run(args, getattr(args, "passthrough", []))


def error_exit_code(exc: BaseException) -> int | None:
    """Exit code for an error the CLI reports in one line, None for a bug (keep the traceback).

    2 = bad input (model, head, data, question, unknown layer), 1 = a failure while running
    (capture budget, missing rows, refused architecture, dead engine).
    """
    if isinstance(exc, UheadError):
        return exc.exit_code
    if isinstance(exc, (ValueError, FileNotFoundError, FileExistsError)):
        return 2
    return None


def main(argv: Sequence[str] | None = None) -> int:
    # vLLM's import-time deprecation noise says nothing to a user of this CLI.
    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.passthrough = rest
    try:
        return int(args.func(args) or 0)
    except Exception as exc:  # noqa: BLE001  (re-raised below unless it is a known error)
        code = error_exit_code(exc)
        if code is None:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"uhead-vllm {args.command}: error: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
