"""Where every Python process of a run spends its time, on a machine where no profiler attaches.

Put this folder first on PYTHONPATH (or copy this file into the carried site-packages) and set
``UHEAD_STACK_DIR``: each process (servers, API servers, vLLM's engine core) then samples its
threads' stacks into ``<dir>/<pid>.txt`` (collapsed stacks, experiments/value/stack_sampler.py),
every ``UHEAD_STACK_INTERVAL`` seconds (default 0.005).
"""

import os

if os.environ.get("UHEAD_STACK_DIR"):
    from pathlib import Path

    try:
        from experiments.value import stack_sampler
    except ImportError:  # a process started outside the checkout
        stack_sampler = None
    if stack_sampler is not None:
        stack_sampler.start(Path(os.environ["UHEAD_STACK_DIR"]) / f"{os.getpid()}.txt",
                            interval=float(os.environ.get("UHEAD_STACK_INTERVAL", "0.005")), flush_every=3.0)
