"""Engine configurations under test and one timed "run" per configuration.

Every configuration runs the same prompts with the same sampling settings and the same vLLM engine
settings; they differ only in what capture is installed:

- ``plain``: stock vLLM, nothing captured (the reference);
- ``ours``: ``uhead_vllm`` capture, results through ``VllmHiddenStatesGenerator`` (exact rows for
  every token, prefix-cached rows filled from the store), storage dtype fp32 or bf16;
- ``common``: the common approach (``baseline_extension``): eager-only forward hooks, per-request
  per-layer float32 numpy arrays, pickled through ``collective_rpc``.

A run resets the prefix cache (and our row store) first, so every repeat does the same work.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from uhead_vllm.generation.backends.transports import shared_row_files

from . import baseline_extension
from .workload import Workload


@dataclass(frozen=True)
class Config:
    kind: str  # "plain" | "ours" | "common"
    mode: str  # "compiled" | "eager"
    storage: str | None = None  # capture storage dtype for "ours"

    @property
    def name(self) -> str:
        tail = f"-{self.storage}" if self.storage and self.kind == "ours" else ""
        return f"{self.kind}-{self.mode}{tail}"

    def __post_init__(self) -> None:
        if self.kind not in ("plain", "ours", "common"):
            raise ValueError(f"unknown config kind {self.kind!r}")
        if self.mode not in ("compiled", "eager"):
            raise ValueError(f"unknown mode {self.mode!r}")
        if self.kind == "common" and self.mode != "eager":
            raise ValueError("the common approach needs eager mode: hooks never fire in compiled graphs")


@dataclass
class RunResult:
    seconds: float
    generated_tokens: int
    rows: int | None = None  # captured rows handed to the caller (None for plain)
    rows_forwarded: int | None = None  # rows the worker captured during the forward passes
    payload_bytes: int | None = None  # bytes that crossed the capture RPC
    hidden_bytes: int | None = None  # bytes of the hidden-state tensors returned to the caller
    extra: dict = field(default_factory=dict)
    cpu_seconds: float | None = None  # CPU time of this process (all threads) during the pass

    @property
    def tok_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def tok_per_cpu_s(self) -> float | None:
        return self.generated_tokens / self.cpu_seconds if self.cpu_seconds else None


def _row_parts(sample: Any) -> tuple[Any, ...]:
    """A sample's rows as the generator holds them: its prompt part (a view shared by the prompt's
    samples, where the generator shares them) and its own part; ``hidden`` where there are no parts
    (asking a sharing generator's ``hidden`` would build a contiguous copy)."""
    if hasattr(sample, "own_rows"):
        return sample.prompt_rows, sample.own_rows
    return (sample.hidden,)


def _generated(outputs: list[Any]) -> int:
    return sum(len(o.token_ids) for ro in outputs for o in ro.outputs)


class Runner:
    """Owns one engine; ``run`` times one pass of a workload, ``close`` frees the engine."""

    def __init__(self, config: Config, model: str, model_dtype: str, layers: tuple[int, ...],
                 engine: dict, prompts: list[str], workload: Workload, max_capture_bytes: int = 8 << 30):
        self.config = config
        self.max_capture_bytes = max_capture_bytes
        self.layers = tuple(layers)
        self.prompts = prompts
        self.workload = workload
        t0 = time.perf_counter()
        self.llm = self._build(model, model_dtype, engine)
        self.gen = None
        if config.kind == "ours":
            from uhead_vllm.generation import VllmHiddenStatesGenerator

            self.gen = VllmHiddenStatesGenerator(self.llm, store_max_bytes=4 << 30)
            self._wrap_fetch()
            self._wrap_generate()
        elif config.kind == "common":
            baseline_extension.install(self.llm, list(self.layers))
        self.load_seconds = time.perf_counter() - t0
        self._payload_bytes = 0
        self._rows_forwarded = 0
        self._rows_placed = 0
        self._fetch_seconds = 0.0
        self._generate_seconds = 0.0

    def _build(self, model: str, model_dtype: str, engine: dict) -> Any:
        eager = self.config.mode == "eager"
        if self.config.kind == "ours":
            from uhead_vllm.generation import build_llm

            return build_llm(model, self.layers, dtype=model_dtype, capture_dtype=self.config.storage,
                             max_capture_bytes=self.max_capture_bytes, enforce_eager=eager, **engine)
        from vllm import LLM

        if self.config.kind == "common":
            return LLM(model=model, dtype=model_dtype, **baseline_extension.engine_kwargs(), **engine)
        return LLM(model=model, dtype=model_dtype, enforce_eager=eager, **engine)

    def _wrap_fetch(self) -> None:
        """Time the generator's own fetch (sending it and waiting for the answer) and count the
        bytes of hidden states it hands over (the payload is an object for an in-process engine,
        safetensors bytes otherwise) and the rows the worker placed straight into the
        generator's buffer instead."""
        client = self.gen.client
        fetch, fetch_later = client.fetch, client.fetch_later

        def counted(rows: Any) -> Any:
            if rows.placed:  # written into the generator's buffer during the pass
                self._rows_placed += rows.num_rows
                item = torch.empty(0, dtype=client.settings.torch_dtype).element_size()
                self._payload_bytes += rows.num_rows * len(self.gen.layers) * self.gen.hidden_size * item
            else:
                self._payload_bytes += sum(p.numel() * p.element_size() for p in rows.hidden_parts)
            self._rows_forwarded += rows.num_rows
            return rows

        def timed(f: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                t0 = time.perf_counter()
                try:
                    return f()
                finally:
                    self._fetch_seconds += time.perf_counter() - t0
            return run

        def later() -> Callable[[], Any]:
            wait = timed(fetch_later)()
            return lambda: counted(timed(wait)())

        client.fetch = lambda: counted(timed(fetch)())
        client.fetch_later = later

    def _wrap_generate(self) -> None:
        """Split our wall time: inside vLLM's generate (forwards + worker-side recording) vs after."""
        inner = self.llm.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._generate_seconds += time.perf_counter() - t0

        self.llm.generate = generate

    def run(self, workload: Workload | None = None, keep: list | None = None, *, untagged: bool = False,
            **generate_kwargs: Any) -> RunResult:
        """Time one pass of ``workload``; pass ``keep`` to hold the results (for memory probes);
        ``generate_kwargs`` go to the generator's ``generate`` (capturing configurations only).
        ``untagged``: ask a capturing engine as plain vLLM is asked (``llm.generate``, no capture
        tags: nothing recorded nor fetched), the cost of its capture set-up alone.

        Besides wall time, the process CPU time of the pass is kept: on a machine shared with other
        work, CPU time is less disturbed by waiting for a core than wall time is.
        """
        c0 = time.process_time()
        res = self._run(workload, keep, generate_kwargs, untagged)
        res.cpu_seconds = time.process_time() - c0
        return res

    def _run(self, workload: Workload | None, keep: list | None, generate_kwargs: dict | None = None,
             untagged: bool = False) -> RunResult:
        wl = workload or self.workload
        prompts = self.prompts[: wl.num_prompts]
        sp = wl.sampling_params()
        if self.gen is not None and not untagged:
            self.gen.reset_hs_step_cache(reset_prefix_cache=True)
        elif not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        self._payload_bytes = 0
        self._rows_forwarded = 0
        self._rows_placed = 0
        self._fetch_seconds = 0.0
        self._generate_seconds = 0.0
        gc.collect()
        if self.config.kind == "plain" or untagged:
            t0 = time.perf_counter()
            outputs = self.llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            if keep is not None:
                keep.append(outputs)
            return RunResult(dt, _generated(outputs), extra={"vllm_generate_seconds": dt})
        if self.config.kind == "common":
            t0 = time.perf_counter()
            outputs = self.llm.generate(prompts, sp, use_tqdm=False)
            t1 = time.perf_counter()
            per_request, nbytes = baseline_extension.fetch(self.llm, list(self.layers))
            dt = time.perf_counter() - t0
            rows = sum(int(t.shape[0]) for t in per_request.values())
            hidden_bytes = sum(t.numel() * t.element_size() for t in per_request.values())
            if keep is not None:
                keep.append((outputs, per_request))
            return RunResult(dt, _generated(outputs), rows=rows, rows_forwarded=rows,
                             payload_bytes=nbytes, hidden_bytes=hidden_bytes,
                             extra={"vllm_generate_seconds": t1 - t0, "fetch_seconds": t0 + dt - t1})
        t0 = time.perf_counter()
        res = self.gen.generate(prompts, sp, **(generate_kwargs or {}))
        dt = time.perf_counter() - t0
        parts = [p for per_prompt in res.hidden_states for s in per_prompt for p in _row_parts(s)]
        rows = sum(int(p.shape[0]) for p in parts)
        hidden_bytes = sum(p.numel() * p.element_size() for p in parts)
        if keep is not None:
            keep.append(res)
        st = res.stats
        files = shared_row_files(self.llm)  # with an engine process: shared files made vs handed out again
        return RunResult(dt, _generated(res.outputs), rows=rows, rows_forwarded=self._rows_forwarded,
                         payload_bytes=self._payload_bytes, hidden_bytes=hidden_bytes,
                         extra={"vllm_generate_seconds": self._generate_seconds,
                                "fetch_seconds": self._fetch_seconds,
                                "assembly_seconds": dt - self._generate_seconds - self._fetch_seconds,
                                "rows_from_store": st.rows_from_store,
                                "rows_from_shared_prefix": st.rows_from_shared_prefix,
                                "rows_shared": st.rows_shared,
                                "rows_recomputed": st.rows_recomputed,
                                "prefix_cache_rows": st.prefix_cache_rows,
                                "rows_placed_during_generation": self._rows_placed,
                                "rows_written_on_device": st.rows_written_on_device,
                                "record_seconds": st.record_seconds, "place_seconds": st.place_seconds,
                                "forwards_replayed": st.forwards_replayed,
                                "held_bytes": st.held_bytes, "row_files_created": files.created,
                                "row_files_reused": files.reused})

    def warmup(self, workload: Workload) -> None:
        """Same batch shape as the timed workload, few tokens: compiles kernels, fills caches."""
        self.run(Workload(workload.num_prompts, workload.n, min(8, workload.max_tokens),
                          workload.temperature, workload.ignore_eos))

    def close(self) -> None:
        """Free the engine now: in-process engines otherwise hold their KV cache until collected."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown()
            except Exception:  # shutting down twice or a partly built engine: nothing left to free
                pass
        self.gen = None
        self.llm = None
        gc.collect()
