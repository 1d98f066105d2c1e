"""Peak resident memory of one configuration, measured in a fresh child process.

Method: the parent starts ``python -m experiments.bench.memory SPEC OUT`` per configuration. The
child builds the engine, warms it up, reads its RSS (``rss_ready``), then runs the workload once
while a thread samples RSS every 5 ms, and keeps the results (outputs + hidden states) alive until
the sample is taken, as a caller would. It reports the lifetime peak (VmHWM; ``ru_maxrss`` would inherit the parent's peak across exec), the sampled
peak during the run, and ``run_delta`` = sampled peak - ``rss_ready``: the memory the workload
itself added, which is where captured rows live. A fresh process per configuration keeps one
configuration's freed-but-retained heap from hiding another's.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .env import REPO_ROOT, setup_env

MB = 1 << 20


class RssSampler:
    """Background thread recording the highest RSS seen (psutil), every ``interval`` seconds."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self._proc = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak = max(self.peak, self.rss())
        self._stop.set()
        self._thread.join()


def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_main(spec: dict, out_path: Path) -> None:
    setup_env()
    from .engines import Config, Runner
    from .workload import Workload, rendered_prompts

    wl = Workload(**spec["workload"])
    cfg = Config(**spec["config"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["model"])
    prompts = rendered_prompts(tok, wl.num_prompts)
    runner = Runner(cfg, spec["model"], spec["model_dtype"], tuple(spec["layers"]), spec["engine"],
                    prompts, wl)
    runner.warmup(wl)
    import gc

    gc.collect()
    keep: list = []
    with RssSampler() as sampler:
        ready = sampler.rss()
        result = runner.run(keep=keep)
    out = {
        "config": cfg.name,
        "rss_ready_mb": ready / MB,
        "run_peak_rss_mb": sampler.peak / MB,
        "run_delta_mb": (sampler.peak - ready) / MB,
        # ru_maxrss survives exec, so in a child forked from a big parent it reports the parent's
        # size; VmHWM belongs to the new address space and is the child's own lifetime peak.
        "vm_hwm_mb": _vm_hwm_bytes() / MB,
        "rows": result.rows,
        "hidden_bytes": result.hidden_bytes,
        "payload_bytes": result.payload_bytes,
        "seconds": result.seconds,
    }
    out_path.write_text(json.dumps(out, indent=2))
    del keep
    runner.close()


def measure(spec: dict, out_path: Path, timeout: float) -> dict:
    """Run one child; returns its JSON (or an error record, never a made-up number)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "experiments.bench.memory", json.dumps(spec),
                           str(out_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stderr or "")[-2000:]
        return {"config": spec["config"], "error": f"child exited {proc.returncode}: {tail}"}
    res = json.loads(out_path.read_text())
    res["child_seconds"] = time.perf_counter() - t0
    return res


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]), Path(sys.argv[2]))
