"""One vLLM engine with its engine core and worker in their own processes, for the whole session
(``scripts/capture_in_subprocess.py``, ~50 s on a 2-core machine): it captures rows for
test_capture.py, then its engine core is killed for test_errors.py's dead-engine check. Only
safetensors and JSON cross the process boundary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "capture_in_subprocess.py"


@dataclass
class MultiprocessRun:
    proc: subprocess.CompletedProcess
    rows: Path  # safetensors: raw rows, the generator's rows both ways, counters in its metadata
    dead: Path  # JSON: the error each call named once the engine core was killed
    model: Path
    layers: list[int]

    def check_ran(self) -> None:
        assert self.proc.returncode == 0, self.proc.stderr[-4000:]


@pytest.fixture(scope="session")
def multiprocess_run(tiny_models, tmp_path_factory) -> MultiprocessRun:
    from capture_checks import layers_for

    model = tiny_models["qwen3"]
    layers = list(layers_for(model))
    out = tmp_path_factory.mktemp("multiprocess")
    rows, dead = out / "rows.safetensors", out / "dead.json"
    env = {k: v for k, v in os.environ.items() if k != "UHEAD_FILE_WRITES"}  # the script chooses per call
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # this checkout's package
    proc = subprocess.run([sys.executable, str(SCRIPT), str(model), str(rows), "eager", json.dumps(layers), str(dead)],
                          capture_output=True, text=True, timeout=600, env=env)
    return MultiprocessRun(proc, rows, dead, model, layers)
