"""Where a thread's time goes, from py-spy's sampled stacks: per frame, the milliseconds per run in
which it was on the stack (inclusive), and which frames grow from one way of running to another.

``ablate_capture --spy PY_SPY`` records the engine-core process with py-spy during every run
(``py-spy record --format raw --threads --nonblocking``: samples taken without stopping the
process, only while a thread is on a core) and writes the table this module makes. A frame is
``function (last two path parts)``, line numbers dropped, so a function's samples add up.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

#: ``thread (TID): NAME;frame;frame... COUNT`` (py-spy's raw format with ``--threads``).
_LINE = re.compile(r"^thread \((?P<tid>\d+)\)[^;]*(?P<frames>(;.*)?) (?P<count>\d+)$")
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(:\d+)?\)$")


def frame_name(frame: str) -> str:
    """``fn (a/b/c.py:12)`` as ``fn (b/c.py)``."""
    m = _FRAME.match(frame)
    if m is None:
        return frame
    return f"{m['fn']} ({'/'.join(Path(m['file']).parts[-2:])})"


def inclusive_samples(raw: str, tid: int) -> tuple[Counter, int]:
    """Per frame, the samples of thread ``tid`` with that frame on the stack; and all its samples."""
    per_frame: Counter = Counter()
    total = 0
    for line in raw.splitlines():
        m = _LINE.match(line.strip())
        if m is None or int(m["tid"]) != tid:
            continue
        count = int(m["count"])
        total += count
        for name in {frame_name(f) for f in m["frames"].split(";") if f}:
            per_frame[name] += count
    return per_frame, total


def per_run_ms(files: list[Path], tid: int, rate: int) -> tuple[dict[str, float], float]:
    """Mean milliseconds per run on the stack, per frame, over ``files`` (one per run); and the
    thread's mean sampled milliseconds per run."""
    frames: Counter = Counter()
    total = 0
    for f in files:
        c, t = inclusive_samples(f.read_text(), tid)
        frames.update(c)
        total += t
    scale = 1e3 / rate / max(1, len(files))
    return {k: v * scale for k, v in frames.items()}, total * scale


def growth_table(base: dict[str, float], other: dict[str, float], base_name: str, other_name: str,
                 top: int = 30) -> list[str]:
    """Markdown rows: the frames whose time per run grows most from ``base`` to ``other``."""
    names = sorted(set(base) | set(other), key=lambda k: other.get(k, 0.0) - base.get(k, 0.0), reverse=True)
    rows = [f"| frame | {base_name} ms | {other_name} ms | growth ms |", "|---|---:|---:|---:|"]
    for k in names[:top]:
        a, b = base.get(k, 0.0), other.get(k, 0.0)
        rows.append(f"| `{k}` | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    return rows
