"""Kill a multiprocess engine's core process and report how uhead_vllm names the failure.

Usage: python dead_engine.py MODEL OUT.json. Writes {"generate": <error class>, "client": <error class>}.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"


def main() -> None:
    import psutil
    from vllm import SamplingParams

    from uhead_vllm.generation import VllmHiddenStatesGenerator, build_llm

    model, out = sys.argv[1], sys.argv[2]
    llm = build_llm(model, [0, 2], enforce_eager=True, block_size=32, kv_cache_memory_bytes=64 << 20,
                    max_model_len=256, max_num_seqs=4, seed=0)
    gen = VllmHiddenStatesGenerator(llm)
    ok = gen.generate(["the cat sat"], SamplingParams(max_tokens=3, temperature=0.0))
    assert ok.hidden_states[0][0].hidden.shape[0] > 0
    for child in psutil.Process().children(recursive=True):
        if "EngineCore" in child.name():
            child.kill()
    # Wait until vLLM's monitor thread has marked the engine dead: a generate call made before
    # that hangs inside vLLM 0.32 (a race of its own, not ours).
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    deadline = time.monotonic() + 60
    while resources is not None and not resources.engine_dead and time.monotonic() < deadline:
        time.sleep(0.2)
    result = {}
    for what, call in [("generate", lambda: gen.generate(["the cat sat"], SamplingParams(max_tokens=3))),
                       ("client", lambda: VllmHiddenStatesGenerator(llm))]:
        try:
            call()
            result[what] = None
        except Exception as exc:  # noqa: BLE001  (reported to the test)
            result[what] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    with open(out, "w") as fh:
        json.dump(result, fh)
    os._exit(0)  # the dead engine's shutdown hooks would only add noise


if __name__ == "__main__":
    main()
