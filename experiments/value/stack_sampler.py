"""Opt-in wall-clock stack sampler for study runs on machines where no profiler can attach.

``UHEAD_STACK_SAMPLES=path`` makes :func:`start_from_env` run a daemon thread that samples every
Python thread's stack (``sys._current_frames``) every ``interval`` seconds and rewrites ``path``
with the counts as collapsed stacks (``thread;outer;...;inner count``, the input of flame-graph
tools) every ``flush_every`` seconds and at exit, so a run cut by a time limit still leaves them.
A sample costs a few microseconds per thread; C code holding the GIL shows as its Python caller.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path


def _collapsed(frame) -> str:
    names = []
    while frame is not None:
        code = frame.f_code
        names.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")
        frame = frame.f_back
    return ";".join(reversed(names))


def start(path: Path, interval: float = 0.05, flush_every: float = 20.0) -> None:
    """Sample all threads into ``path`` until the process ends."""
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def write() -> None:
        with lock:
            text = "".join(f"{stack} {n}\n" for stack, n in counts.most_common())
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def loop() -> None:
        me, last = threading.get_ident(), time.monotonic()
        while True:
            time.sleep(interval)
            names = {t.ident: t.name for t in threading.enumerate()}
            with lock:
                for ident, frame in sys._current_frames().items():
                    if ident != me:
                        counts[f"{names.get(ident, ident)};{_collapsed(frame)}"] += 1
            if time.monotonic() - last >= flush_every:
                write()
                last = time.monotonic()

    path.parent.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=loop, name="stack-sampler", daemon=True).start()
    atexit.register(write)


def start_from_env(var: str = "UHEAD_STACK_SAMPLES") -> None:
    """Start the sampler when ``var`` names an output file."""
    if os.environ.get(var):
        start(Path(os.environ[var]))
