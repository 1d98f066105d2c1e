"""``uhead-vllm serve``: vLLM's own OpenAI server with capture and the uncertainty middleware.

Our flags are taken here; every other argument goes to vLLM's own ``serve`` parser unchanged, and
the server is vLLM's ``run_server``. Defaults depend on the platform, unless a vLLM flag overrides:
on a CUDA GPU vLLM's own (the model's dtype, CUDA graphs, memory from ``--gpu-memory-utilization``);
on a CPU the study's that trained the shipped head (fp32 compute, eager, 32-token blocks, a 512 MiB
KV cache). Prefix caching is on and the seed 0 on both.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import tempfile
from typing import Sequence

from ..capture.points import Site, parse_sites
from ..capture.protocol import CAPTURE_KEY, EXTENSION_QUALNAME, CaptureSettings
from ..errors import InputError
from ..generation.engine import config_streams
from .install import DEFAULT_MAX_ROWS_BYTES, DEFAULT_STORE_BYTES, MULTI_STREAM_REFUSAL, SERVE_KEY

MIDDLEWARE = "uhead_vllm.serving.UncertaintyMiddleware"
#: vLLM flags we set unless the user passes them (flag, value or None for a switch), by platform.
VLLM_DEFAULTS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "cuda": (("--seed", "0"), ("--enable-prefix-caching", None), ("--port", "8000")),
    "cpu": (("--dtype", "float32"), ("--enforce-eager", None), ("--block-size", "32"),
            ("--max-model-len", "1024"), ("--kv-cache-memory-bytes", str(512 << 20)), ("--seed", "0"),
            ("--enable-prefix-caching", None), ("--port", "8000")),
}


def platform() -> str:
    """``cuda`` on vLLM's CUDA platform, else ``cpu`` (the defaults' key)."""
    from ..adapters.engine import platform_is_cuda

    return "cuda" if platform_is_cuda() else "cpu"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model-cache", default=None, help="where the embedded model is converted to")
    p.add_argument("--head", default=None, help="head directory (default: the shipped head); 'none': rows only")
    p.add_argument("--allow-other-weights", action="store_true", help="accept a head trained on other weights")
    p.add_argument("--layers", type=int, nargs="+", help="HF hidden-state indices to capture "
                   "(default: the head's layers; with --head none: 0, middle, last)")
    p.add_argument("--capture-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype rows are kept in (the shipped head was trained on bfloat16 rows)")
    p.add_argument("--max-rows-bytes", type=int, default=DEFAULT_MAX_ROWS_BYTES,
                   help="largest rows budget a request may ask for (uncertainty.max_bytes)")
    p.add_argument("--row-store-bytes", type=int, default=DEFAULT_STORE_BYTES,
                   help="memory for prompt rows the prefix cache skips (exact refill)")
    p.add_argument("--points", nargs="+", metavar="POINT.LAYER", default=None,
                   help="capture points inside decoder layers too, e.g. mlp_out.14 attn_in.14 (attn_in = pre_attn, "
                        "attn_out = post_attn, mlp_in, mlp_out; decoder layer 0..n-1); requests ask for them in "
                        "uncertainty.rows.points; eager engines")
    p.add_argument("--steering", action="store_true",
                   help="let requests steer (a 'steer' field: vectors added at named points; eager engines)")
    p.add_argument("--scores-on-device", action="store_true",
                   help="reduce each token's rows to the head's inputs inside the worker (D numbers per token, "
                        "not layers x hidden): scores only, requests for rows or features get 400")


def vllm_argv(args: argparse.Namespace, passthrough: Sequence[str]) -> list[str]:
    """The argument list for vLLM's own server parser."""
    from ..models import model_identity, resolve_model

    path = resolve_model(args.model, args.model_cache)
    on_device = bool(getattr(args, "scores_on_device", False))
    serve = {"max_rows_bytes": args.max_rows_bytes, "store_bytes": args.row_store_bytes,
             "allow_other_weights": args.allow_other_weights, **({"scores_on_device": True} if on_device else {})}
    if args.head:
        serve["head"] = args.head if args.head == "none" else os.path.abspath(os.path.expanduser(args.head))
    settings = capture_settings(str(path), serve.get("head"), args.layers, args.capture_dtype,
                                getattr(args, "points", None) or [], bool(getattr(args, "steering", False)), on_device)
    argv = ["--model", str(path), "--worker-extension-cls", EXTENSION_QUALNAME,
            "--additional-config", json.dumps({CAPTURE_KEY: settings.to_dict(), SERVE_KEY: serve}),
            "--middleware", MIDDLEWARE]
    given = {a.split("=", 1)[0] for a in passthrough if a.startswith("--")}
    if "--served-model-name" not in given:
        argv += ["--served-model-name", model_identity(path)["name"]]
    for flag, value in VLLM_DEFAULTS[platform()]:
        negated = "--no-" + flag[2:]
        if flag not in given and negated not in given:
            argv += [flag] if value is None else [flag, value]
    return argv + list(passthrough)


def capture_settings(model: str, head: str | None, layers: Sequence[int] | None, capture_dtype: str = "bfloat16",
                     points: Sequence[str] = (), steering: bool = False, scores_on_device: bool = False) -> CaptureSettings:
    """What the server's engine captures for ``model``: ``layers``, else the head's (``head``: a
    directory, None for the shipped head, ``none`` for rows only: layer 0, the middle and the last).
    ``scores_on_device``: the head's layers, reduced in the worker by its token inputs (written to
    a temporary file now, removed when this process exits). Refuses models of several residual
    streams before vLLM starts."""
    streams, cfg = config_streams(model)
    if streams > 1:
        raise InputError(MULTI_STREAM_REFUSAL.format(streams=streams))
    if not cfg:
        raise InputError(f"{model}: no config.json (uhead_vllm serves a local Hugging Face model folder)")
    num_layers = int((cfg.get("text_config") or cfg)["num_hidden_layers"])
    if scores_on_device:
        return _reduced_settings(model, head, layers, points, steering)
    layers = list(layers or _default_layers(head, num_layers))
    return CaptureSettings(tuple(layers), capture_dtype, points=parse_points(points, num_layers), steering=steering)


def _reduced_settings(model: str, head: str | None, layers: Sequence[int] | None, points: Sequence[str],
                      steering: bool) -> CaptureSettings:
    """The served head's layers with its token inputs: ``--scores-on-device``."""
    if head == "none" or points:
        raise InputError("--scores-on-device reduces rows to the served head's inputs: it needs a head "
                         "(not --head none) and no --points")
    from ..heads import default_head_dir, load_head

    loaded = load_head(default_head_dir() if head is None else os.path.expanduser(head))
    try:
        inputs = loaded.token_inputs()
    except NotImplementedError as exc:
        raise InputError(f"--scores-on-device: {exc}") from None
    if layers and tuple(layers) != inputs.layers:
        raise InputError(f"--scores-on-device captures the head's layers {list(inputs.layers)}: drop --layers")
    fd, path = tempfile.mkstemp(prefix="uhead-token-inputs-", suffix=".safetensors")
    os.close(fd)
    atexit.register(_remove, path)
    inputs.save(path)
    return CaptureSettings(inputs.layers, "float32", steering=steering, token_inputs=path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def parse_points(values: Sequence[str], num_layers: int) -> tuple[Site, ...]:
    """``--points`` values (``mlp_out.14``; ``mlp_out:14`` and comma-separated lists accepted too)
    as canonical sites; ``InputError`` for an unknown point or a layer the model does not have."""
    items = [v.strip().replace(":", ".") for value in values for v in value.split(",") if v.strip()]
    try:
        sites = parse_sites(items)
    except ValueError as exc:
        raise InputError(f"--points: {exc}") from None
    bad = [f"{p}.{k}" for p, k in sites if k >= num_layers]
    if bad:
        raise InputError(f"--points {bad}: this model has {num_layers} decoder layers (0..{num_layers - 1})")
    return sites


def refuse_compiled(args: argparse.Namespace, vargs: argparse.Namespace) -> None:
    """Points and steering are hooks on decoder submodules, which never fire in a compiled model:
    refuse before vLLM starts instead of failing inside its engine process."""
    what = [w for w, on in (("--points", getattr(args, "points", None)), ("--steering", getattr(args, "steering", False)))
            if on]
    if what and not getattr(vargs, "enforce_eager", False):
        raise InputError(f"serve {' '.join(what)} needs an eager engine (forward hooks on the decoder layers' "
                         "submodules never fire in compiled mode): drop --no-enforce-eager")


def _default_layers(head: str | None, n_layers: int) -> list[int]:
    if head == "none":
        return [0, n_layers // 2, n_layers]
    from ..heads import HeadConfig, default_head_dir

    path = default_head_dir() if head is None else os.path.expanduser(head)
    layers = HeadConfig.load(os.path.join(path, "config.json")).layers
    assert layers is not None  # a head's config names the layers it reads (list(None) would fail the same way)
    return list(layers)


def run(args: argparse.Namespace, passthrough: Sequence[str]) -> int:
    """Parse with vLLM's own serve parser and run vLLM's own server (blocks until shut down)."""
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    from ..runtime import REPO_ROOT

    if REPO_ROOT is not None:  # share compile caches with tests and benchmarks
        os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO_ROOT / ".cache" / "vllm"))
    from ..adapters.server import parse_serve_args, run_api_server

    argv = vllm_argv(args, passthrough)
    vargs = parse_serve_args(argv, prog="uhead-vllm serve")
    refuse_compiled(args, vargs)
    print(f"uhead-vllm serve: vLLM {' '.join(argv)}", file=sys.stderr, flush=True)
    run_api_server(vargs)
    return 0
