"""Where vLLM's engine core threads spent their active time, from the stack samples of a run.

    python -m experiments.gpu.stack_sampling.summarize DIR

``DIR`` holds the ``<pid>.txt`` files the sitecustomize of this folder wrote. Each engine core
(a file with ``run_busy_loop`` frames) gets one table: the main thread's samples inside the busy
loop, idle ones (waiting for input) left out, by category, and the capture frames of this project
by line. Samples are taken when the sampler gets the GIL, so C code that releases it (device
waits, torch ops) is over-represented; compare engine cores of one run, not absolute shares.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

#: (category, any of these substrings in the stack), first match wins
CATEGORIES = [
    ("uhead_take (row take RPC)", ("uhead_take",)),
    ("capture recorder (per step)", ("recorder.py", "held.py")),
    ("wait for the device (get_output)", ("get_output",)),
    ("sample_tokens (vLLM)", ("sample_tokens",)),
    ("execute_model (vLLM)", ("execute_model",)),
    ("requests and utility calls", ("_invoke_utility_method", "_handle_client_request")),
    ("scheduler", ("schedule",)),
]
OURS = ("recorder.py", "held.py", "extension.py", "protocol.py", "row_files.py", "cuda_streams.py")


def summarize(path: Path) -> str | None:
    cats: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if frames[0] != "MainThread" or not any("run_busy_loop" in f for f in frames):
            continue
        if "_process_input_queue" in stack and "wait (threading" in stack:
            continue  # idle
        n = int(count)
        cats[next((c for c, keys in CATEGORIES if any(k in stack for k in keys)), "other")] += n
        mine = [f for f in frames if any(o in f for o in OURS)]
        if mine:
            ours[mine[-1]] += n
    total = sum(cats.values())
    if not total:
        return None
    lines = [f"## engine core {path.stem}: {total} active samples", "", "| share | samples | where |", "|---:|---:|---|"]
    lines += [f"| {n / total:.3f} | {n} | {c} |" for c, n in cats.most_common()]
    lines += ["", "Innermost capture frames:", ""] + [f"- {n} {f}" for f, n in ours.most_common(10)]
    return "\n".join(lines) + "\n"


def main() -> None:
    folder = Path(sys.argv[1])
    for path in sorted(folder.glob("*.txt")):
        table = summarize(path)  # None for a process that is no engine core
        if table:
            print(table)


if __name__ == "__main__":
    main()
