"""GPU capture parity on the real CUDA vLLM engine; skipped where no GPU is present (CI).

Each configuration runs ``experiments.gpu.capture_parity`` in its own process (vLLM reads the
runner choice once per process): both runners (V1 ``GPUModelRunner``, Model Runner V2), CUDA graphs
on (vLLM's default FULL_AND_PIECEWISE) and eager mode, n>1, prefix caching, a multi-step best-of-n
loop, strict mode. Rows are compared with Hugging Face's forward on the GPU, relative L2 per row:
fp32 within 5e-3 (GPU fp32 attention differs from HF's by ~1.5e-3), bf16 within 5e-2.

Run on the GPU machine (see ../shared/gpu/README.md for carrying vLLM there):
    UHEAD_GPU_TOKENIZER=<dir with tokenizer.json> UHEAD_GPU_RESULTS=$OUT python -m pytest tests/gpu -n 5
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = {"float32": 5e-3, "bfloat16": 5e-2}
CONFIGS = [  # (runner, mode, backend, how placed rows reach the engine core process's row file)
    ("v2", "graphs", "aux", "file-writer"),
    ("v2", "eager", "aux", "file-writer"),
    ("v1", "graphs", "aux", "file-writer"),
    ("v1", "eager", "aux", "placer"),
]


def test_extract_backend_is_refused_on_gpu_with_a_reason(tmp_path: Path) -> None:
    """Measured on an H100 (vLLM 0.26): V2 refuses extract_hidden_states; on V1 the prefix cache
    could not be reset after generation. The backend is refused before an engine is built."""
    from uhead_vllm.generation import build_llm

    with pytest.raises(NotImplementedError, match="not supported on GPU.*backend='aux'"):
        build_llm("unused-model-path", (0,), backend="extract", capture_dir=str(tmp_path))


def _random_model(tmp_path_factory: pytest.TempPathFactory, shape: str) -> Path:
    """A random-weight Llama of ``shape`` (fp32 weights) with the carried tokenizer."""
    sys.path.insert(0, str(REPO))
    from experiments.gpu.models import build_model

    tok = os.environ.get("UHEAD_GPU_TOKENIZER")
    if not tok:
        from uhead_vllm.models import embedded_model_path

        tok = str(embedded_model_path())
    return build_model(tmp_path_factory.getbasetemp() / f"{shape}-random", shape, Path(tok), save_weights=True)


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _random_model(tmp_path_factory, "smollm2")


def _parity(gpu_model: Path, runner: str, mode: str, backend: str, tmp_path: Path, tp: int = 1,
            writes: str = "file-writer") -> None:
    """``writes``: with the engine core in its own process, placed rows reach the shared row file
    written by the GPU itself (``file-writer``, ``UHEAD_FILE_WRITES=1``) or through the host
    placer (the default)."""
    from uhead_vllm.envs import FILE_WRITES_ENV

    out_dir = Path(os.environ.get("UHEAD_GPU_RESULTS", tmp_path))
    name = f"parity-{runner}-{mode}-{backend}" + (f"-tp{tp}" if tp > 1 else "") + f"-{writes}"
    out = out_dir / f"{name}.json"
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "v2" else "0",
           FILE_WRITES_ENV: "1" if writes == "file-writer" else "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.gpu.capture_parity", "--model", str(gpu_model), "--mode", mode,
         "--backend", backend, "--tp", str(tp), "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    (out_dir / f"{name}.log").write_text(proc.stdout[-20000:] + proc.stderr[-60000:])
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    assert result["runner"] == runner
    totals = result["totals"]
    assert totals["capture_missed_rows"] == 0 and totals["rows_recomputed"] == 0, totals
    assert totals["rows_from_store"] > 0, "phase B should have served prefix-cached rows from the store"
    assert result["rows_checked"] > 1000
    if mode == "graphs":  # FULL-graph outputs stay at their addresses: the step copies replay as graphs
        assert totals["forwards_replayed"] > 0, totals
    engine_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1" or tp > 1  # else a buffer, no file
    assert totals["rows_placed"] > 0, totals
    on_device = totals["rows_placed"] if writes == "file-writer" and engine_process else 0
    assert totals["rows_written_on_device"] == on_device, totals
    tol = TOLERANCE[result["dtype"]]
    worst = max(result["max_rel_l2_per_layer"].values())
    assert worst < tol, result["max_rel_l2_per_layer"]
    assert result["tp"] == tp


@pytest.mark.parametrize("runner,mode,backend,writes", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_rows_equal_hf_on_gpu(gpu_model: Path, runner: str, mode: str, backend: str, writes: str,
                              tmp_path: Path) -> None:
    _parity(gpu_model, runner, mode, backend, tmp_path, writes=writes)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_rows_equal_hf_with_tensor_parallel_2_and_cuda_graphs(tmp_path_factory: pytest.TempPathFactory,
                                                              tmp_path: Path) -> None:
    """TP=2 (vLLM's default runner, CUDA graphs): workers are separate processes, rows come from
    rank 0 through the shared-memory destination; same phases and tolerance as one GPU. SmolLM2's 9
    attention heads do not split over 2 GPUs: its depth with 8 heads (``smollm2_tp``)."""
    _parity(_random_model(tmp_path_factory, "smollm2_tp"), "v2", "graphs", "aux", tmp_path, tp=2)


@pytest.mark.parametrize("runner,mode,writes", [("v2", "graphs", "file-writer"), ("v1", "eager", "placer")])
def test_capture_windows_and_shared_prompt_rows_on_gpu(gpu_model: Path, runner: str, mode: str, writes: str,
                                                       tmp_path: Path) -> None:
    """Capture windows ("all", then "generated" and 24 prompt rows prefix-cached, "generated" cold) and the samples
    of a prompt sharing its rows, n=4, strict (tests/gpu/window_parity.py): rows inside the windows
    equal HF's, nothing outside them crossed to the host, a cached prompt costs the generated
    window no fill and no recompute, every sample's prompt part is sample 0's."""
    result = _case("window_parity.py", "windows", gpu_model, runner, mode, writes, tmp_path)
    phases = result["phases"]
    assert phases["generated_cold"]["rows_skipped"] > 0 and phases["k24_cached"]["rows_from_store"] > 0
    assert all(p["capture_missed_rows"] == 0 for p in phases.values()), phases
    # samples share prompt rows where the window holds some (a generated window has none to share)
    assert phases["all"]["rows_shared"] > 0 and phases["k24_cached"]["rows_shared"] > 0, phases
    assert result["rows_checked"] > 1000
    assert max(result["max_rel_l2_per_layer"].values()) < TOLERANCE[result["dtype"]], result["max_rel_l2_per_layer"]


@pytest.mark.parametrize("runner,mode,writes", [("v2", "graphs", "file-writer"), ("v1", "eager", "placer")])
def test_rows_reduced_to_a_heads_inputs_on_gpu(gpu_model: Path, runner: str, mode: str, writes: str,
                                               tmp_path: Path) -> None:
    """An engine built with token inputs (``D = 128``, layers out of order): every sample's rows are
    ``[rows, 1, D]`` and equal the weight applied to HF's rows, n=4, cold, prefix-cached and the
    generated window, strict (tests/gpu/reduced_parity.py); only D float32 values per row crossed."""
    result = _case("reduced_parity.py", "reduced", gpu_model, runner, mode, writes, tmp_path)
    phases = result["phases"]
    assert phases["all_cached"]["rows_from_store"] > 0 and phases["generated"]["rows_skipped"] > 0, phases
    assert all(p["capture_missed_rows"] == 0 for p in phases.values()), phases
    assert result["rows_checked"] > 1000
    assert result["max_rel_l2"] < TOLERANCE[result["dtype"]], result["max_rel_l2"]


def _case(script: str, kind: str, gpu_model: Path, runner: str, mode: str, writes: str, tmp_path: Path) -> dict:
    """Run one parity script of tests/gpu in its own process (vLLM reads the runner once) and return
    its result after the checks every case shares: it finished, on the runner asked, without problems."""
    from uhead_vllm.envs import FILE_WRITES_ENV

    out_dir = Path(os.environ.get("UHEAD_GPU_RESULTS", tmp_path))
    name = f"{kind}-{runner}-{mode}-{writes}"
    out = out_dir / f"{name}.json"
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "v2" else "0",
           FILE_WRITES_ENV: "1" if writes == "file-writer" else "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "gpu" / script), "--model", str(gpu_model),
                           "--mode", mode, "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    (out_dir / f"{name}.log").write_text(proc.stdout[-20000:] + proc.stderr[-60000:])
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    assert result["runner"] == runner and result["problems"] == [], result["problems"]
    return result
