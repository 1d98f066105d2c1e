"""Command-line options shared by the ``uhead-vllm`` command (:mod:`uhead_vllm.cli`) and the study's
commands (:mod:`uhead_vllm.study.commands`): progress and threads, and where a job's engines run.
Both import them from here, so the CLI, which registers the study's commands, stays the only side
that imports the other."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_common_args(p: argparse.ArgumentParser, threads: bool = True) -> None:
    """``--no-progress`` (and ``--threads``) of the commands that train or score heads."""
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    if threads:
        p.add_argument("--threads", type=int, default=1,
                       help="torch threads for head training/scoring (default 1: fastest on a busy 2-core CPU)")


def add_scaleout_args(p: argparse.ArgumentParser) -> None:
    """``--ray [ADDRESS]`` and the replica shape, ``--engine-args`` (for jobs that build engines)."""
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray actors, one engine each: a local cluster (no ADDRESS) or the cluster at "
                        "ADDRESS ('auto', 'ray://host:10001'); needs the extra 'ray'")
    p.add_argument("--replicas", type=int, default=2, help="engine actors with --ray (default 2)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs per actor (default 1)")
    p.add_argument("--gpus-per-replica", type=float, default=0.0,
                   help="Ray GPUs per actor (default 0; 1 = one engine per GPU, N = tensor parallel inside it)")
    p.add_argument("--engine-args", default=None, metavar="JSON",
                   help='vLLM settings replacing the job\'s CPU defaults, e.g. \'{"dtype": "bfloat16", '
                        '"enforce_eager": false}\' on a GPU')


def scaleout_options(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """(:class:`~uhead_vllm.scaleout.RayOptions` or None, engine overrides) from the arguments of
    :func:`add_scaleout_args`."""
    engine = json.loads(args.engine_args) if args.engine_args else {}
    if not isinstance(engine, dict):
        raise ValueError("--engine-args must be a JSON object")
    if args.ray is None:
        return None, engine
    from .scaleout import RayOptions

    return RayOptions(address=None if args.ray == "local" else args.ray, replicas=args.replicas,
                      cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica), engine
