"""The study's opt-in stack sampler records where the threads of a process spend their time."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_samples_name_the_busy_function_and_exclude_the_sampler(tmp_path: Path) -> None:
    out = tmp_path / "stacks.txt"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from experiments.value import stack_sampler
        stack_sampler.start_from_env()
        def busy_for_a_while():
            end = time.monotonic() + 0.6
            while time.monotonic() < end:
                pass
        busy_for_a_while()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env={"UHEAD_STACK_SAMPLES": str(out)}, timeout=60)
    lines = out.read_text().splitlines()
    busy = sum(int(line.rsplit(" ", 1)[1]) for line in lines if "busy_for_a_while" in line)
    assert busy >= 5, lines  # ~12 samples at 50 ms
    assert all(line.startswith("MainThread;") for line in lines), lines
