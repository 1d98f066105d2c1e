"""Shared test set-up: a quiet, in-process vLLM on CPU and cached offline models.

The environment defaults are set at import time, before any test module imports vLLM, because vLLM
reads most of them once when it is first imported.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_ROOT = REPO_ROOT / ".cache"
# Plain `pytest` (unlike `python -m pytest`) does not put the repo on sys.path; the package may
# not be pip-installed yet.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

if os.environ.get("PYTEST_XDIST_WORKER") and not Path("/dev/nvidiactl").exists():
    # Workers on a CPU machine (CI: two on two cores): one thread each (vLLM's CPU kernels check
    # the thread count an attention call was planned with), and vLLM's engines left unbound, so
    # that the workers' engines do not share the core vLLM's automatic binding picks for all.
    # GPU runs (tests/gpu -n 5) keep their threads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from uhead_vllm.runtime import set_env_defaults  # noqa: E402  (does not import vLLM)

# In-process engines, quiet logs, compile caches in <repo>/.cache, no hub access.
set_env_defaults()

from uhead_vllm._testing import TINY_MODEL_VERSION, build_tiny_model  # noqa: E402
from uhead_vllm.models import embedded_model_path  # noqa: E402
from serving_server import client, head_path, server  # noqa: E402,F401  (one serving session for the suite)
from multiprocess_engine import multiprocess_run  # noqa: E402,F401  (one multiprocess engine for the suite)

#: Modules that use the session server (serving_server.py): one worker runs them all.
SERVER_MODULES = frozenset({"test_serving.py", "test_serving_control.py", "test_serving_faults.py",
                            "test_serving_page.py"})
#: The longest scopes (≥ 90 s each on two cores), handed out first so that no worker ends alone on one.
LONGEST_FIRST = ("server", "test_architectures.py", "test_scaleout_ray.py", "test_capture.py",
                 "test_serving_embedded.py", "test_speculative_tp.py")


def _scope(nodeid: str) -> str:
    """A test's unit of work for xdist: its module, or ``server`` for the session server's modules."""
    path = nodeid.split("::", 1)[0]
    return "server" if Path(path).name in SERVER_MODULES else path


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a venv without xdist runs the suite too
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist's ``--dist loadfile`` (the README's command: two workers), a module's
    tests run on one worker (its module-scoped engines start once), the modules of the session
    server share one (the server starts once), and the longest scopes go out first. Any other
    ``--dist`` keeps xdist's own scheduling (the GPU tests spread one module's cases over workers)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    def rank(nodeid: str) -> int:
        scope = Path(_scope(nodeid)).name
        return LONGEST_FIRST.index(scope) if scope in LONGEST_FIRST else len(LONGEST_FIRST)

    class ModulesAndServer(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

        def schedule(self) -> None:
            if self.collection is None:  # the first distribution: the longest scopes first
                config.option.loadscopereorder = False
                for node, ids in self.registered_collections.items():
                    self.registered_collections[node] = sorted(ids, key=rank)
            super().schedule()

    return ModulesAndServer(config, log)


# name -> (arch, vocab_pad)
TINY_MODEL_SPECS: dict[str, tuple[str, int]] = {
    "llama": ("llama", 0),
    "qwen3": ("qwen3", 0),
    "qwen3_padded_vocab": ("qwen3", 64),
}


def tiny_model_dir(name: str) -> Path:
    """Cache folder of a tiny model; the version suffix retires folders from older recipes."""
    return CACHE_ROOT / "tiny_models" / f"{name}-v{TINY_MODEL_VERSION}"


def make_vllm_kwargs(**overrides: Any) -> dict[str, Any]:
    """Engine kwargs for tests: small fp32 eager engine, prefix caching on, 32-token blocks."""
    kwargs: dict[str, Any] = dict(
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=512,
        max_num_seqs=16,
        seed=0,
        enable_prefix_caching=True,
    )
    kwargs.update(overrides)
    return kwargs


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """Tiny random models ("llama", "qwen3", "qwen3_padded_vocab"), built once and reused."""
    return {
        name: build_tiny_model(tiny_model_dir(name), arch, vocab_pad=pad)
        for name, (arch, pad) in TINY_MODEL_SPECS.items()
    }


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """SmolLM2-135M-Instruct as a bf16 HF folder, in the same cache the CLI and `scripts/setup.sh`
    use (``$UHEAD_VLLM_MODEL_CACHE`` or ``~/.cache/uhead_vllm/models``), so it is converted once per
    machine (the first conversion takes ≈20-35 s)."""
    return embedded_model_path()


@pytest.fixture(scope="session")
def vllm_kwargs() -> Callable[..., dict[str, Any]]:
    """Call it for the test engine kwargs: ``LLM(model=path, **vllm_kwargs(max_num_seqs=4))``."""
    return make_vllm_kwargs


@pytest.fixture(scope="module", autouse=True)
def _collect_engines_after_module() -> Iterator[None]:
    """Torn down after every other module fixture has dropped its engine: collect them here, at a
    known point, rather than whenever the garbage collector runs (possibly while the next module
    builds its engine, whose parallel state a late shutdown would tear down)."""
    yield
    gc.collect()


@pytest.fixture
def llm_factory() -> Iterator[Callable[..., Any]]:
    """Build ``vllm.LLM`` engines with the test kwargs; they are released when the test ends.

    In-process engines hold their KV cache until collected, so a long session that keeps
    creating engines must drop them explicitly.
    """
    import vllm

    engines: list[Any] = []

    def make(model: str | Path, **overrides: Any) -> Any:
        gc.collect()  # as build_llm does: no dropped engine may shut down while this one is built
        llm = vllm.LLM(model=str(model), **make_vllm_kwargs(**overrides))
        engines.append(llm)
        return llm

    yield make
    engines.clear()
    gc.collect()
