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


def frame_samples(raw: str, tid: int, below: str | None = None) -> tuple[Counter, Counter, int]:
    """Thread ``tid``'s samples per frame: with the frame on the stack (inclusive, counting only
    frames from the first one whose name starts with ``below``: a forked process's stacks begin
    with its parent's frames, on every sample), with the frame on top (self), and all samples."""
    inclusive: Counter = Counter()
    own: Counter = Counter()
    total = 0
    for line in raw.splitlines():
        m = _LINE.match(line.strip())
        if m is None or int(m["tid"]) != tid:
            continue
        count = int(m["count"])
        total += count
        frames = [frame_name(f) for f in m["frames"].split(";") if f]
        if frames:
            own[frames[-1]] += count
        start = next((i for i, f in enumerate(frames) if below and f.startswith(below)), 0)
        for name in set(frames[start:]):
            inclusive[name] += count
    return inclusive, own, total


def per_run_ms(files: list[Path], tid: int, rate: int, below: str | None = None
               ) -> tuple[dict[str, float], dict[str, float], float]:
    """Mean milliseconds per run, over ``files`` (one per run): per frame inclusive and self (see
    :func:`frame_samples`), and the thread's sampled total."""
    inclusive: Counter = Counter()
    own: Counter = Counter()
    total = 0
    for f in files:
        i, o, t = frame_samples(f.read_text(), tid, below)
        inclusive.update(i)
        own.update(o)
        total += t
    scale = 1e3 / rate / max(1, len(files))
    return ({k: v * scale for k, v in inclusive.items()}, {k: v * scale for k, v in own.items()}, total * scale)


def growth_table(base: dict[str, float], other: dict[str, float], base_name: str, other_name: str,
                 top: int = 30) -> list[str]:
    """Markdown rows: the frames whose time per run grows most from ``base`` to ``other``."""
    names = sorted(set(base) | set(other), key=lambda k: other.get(k, 0.0) - base.get(k, 0.0), reverse=True)
    rows = [f"| frame | {base_name} ms | {other_name} ms | growth ms |", "|---|---:|---:|---:|"]
    for k in names[:top]:
        a, b = base.get(k, 0.0), other.get(k, 0.0)
        rows.append(f"| `{k}` | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    return rows
