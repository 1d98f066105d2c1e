"""A decode step's device copies replayed as one CUDA graph.

Copying a step's rows, positions and token ids into the batch buffer is five small kernels; on a
GPU host each launch costs the engine's thread microseconds that a small model's decode step
(~2-5 ms, host-bound) feels: ~0.09 ms a step at SmolLM2's shape (``bench_recorder``). Under CUDA
graphs vLLM's outputs sit at the same addresses step after step, and the batch buffer's targets
recur, so the copy of a given (targets, sources) layout is captured once as a graph and replayed
with one launch afterwards.

A layout is keyed by the targets and every source tensor's address, shape, strides and dtype: a
replay reads exactly what the eager copy would. It is captured the second time it is seen as a
steady step, one whose sources are those of the step before it (decode steps of an unchanged
batch); prefill chunks and the steps where the batch changes stay eager. Those recur too, once a
generation at most, at offsets that differ from call to call: on an H100 host they kept costing
~5 captures (~1.9 ms) per SmolLM2 call at 16 sequences, each worth ~14 replays' savings
(``ablate_capture --spy``, 42642d0). Capture uses the low-level ``CUDAGraph.capture_begin`` on a
side stream in thread-local mode (``torch.cuda.graph`` would synchronise the device, collect garbage
and empty the allocator's cache on the engine's thread). If a capture fails, graphs are turned off
for the recorder and copies stay eager: nothing is lost.

Graphs must pay for themselves: capturing one costs the engine's thread ~0.35 ms (H100 host,
``bench_recorder``), about ten eager copies. A generation of steady batches captures its few
dozen layouts (16 offsets per buffer, two buffers) and replays them for the rest of the call and
the calls after; batches whose size keeps changing (sequences finishing at different steps) may
see a steady layout twice and never again. So beyond :data:`FREE_CAPTURES` graphs, a new one is
captured only while replays outnumber captures :data:`REPLAYS_PER_CAPTURE` to one; otherwise the
copy stays eager (the graphs already captured keep replaying). Both are counted since the graphs were last
dropped (at :data:`MAX_GRAPHS`): counted over all time, the layouts in use after a drop waited for
replays that only the dropped graphs could have earned.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

#: Captured graphs kept at most (then all are dropped and the ones in use are captured again):
#: room for the steady layouts of many batch sizes (32 each).
MAX_GRAPHS = 1024
#: Graphs captured without asking whether they pay (a steady batch's layouts: 2 buffers x 16
#: offsets, step_batch.MAX_STEPS, for a few batch sizes).
FREE_CAPTURES = 128
#: Beyond those, a new graph is captured only while replays are at least this many per capture.
REPLAYS_PER_CAPTURE = 2


class StepGraphs:
    """Copies (target, source) pairs with a captured graph where one fits, eagerly otherwise."""

    def __init__(self, copy_all: Callable[[list[torch.Tensor], list[torch.Tensor]], Any]) -> None:
        self.copy_all = copy_all
        self.enabled = True
        self.captured = 0  # graphs captured (a counter for tests and benchmarks)
        self.replays_total = 0
        self._replays_taken = 0  # replays_total at the last take_replayed
        self._kept_captures = self._kept_replays = 0  # since the graphs were last dropped
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._seen: set[tuple] = set()
        self._last_sources: tuple | None = None  # the sources of the step before
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None

    def copy(self, targets_key: Any, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        """``copy_all(targets, sources)``, on the current stream. ``targets_key`` names the
        targets (persistent views of the batch buffer, the same tensors for the same key)."""
        if not self.enabled:
            self.copy_all(targets, sources)
            return
        sources_key = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in sources)
        steady, self._last_sources = sources_key == self._last_sources, sources_key
        key = (targets_key, sources_key)
        graph = self._graphs.get(key)
        if graph is None:
            if not steady or key not in self._seen:
                if steady:
                    if len(self._seen) >= 4 * MAX_GRAPHS:
                        self._seen.clear()
                    self._seen.add(key)
                self.copy_all(targets, sources)
                return
            graph = self._capture(key, targets, sources) if self._capture_pays() else None
            if graph is None:
                self.copy_all(targets, sources)
                return
        graph.replay()
        self.replays_total += 1
        self._kept_replays += 1

    @property
    def replayed(self) -> int:
        """Replays since the last :meth:`take_replayed`."""
        return self.replays_total - self._replays_taken

    def take_replayed(self) -> int:
        """Replays since the last take; the count starts again from here."""
        replayed, self._replays_taken = self.replayed, self.replays_total
        return replayed

    def _capture_pays(self) -> bool:
        """Whether one more capture is worth it (see the module docstring)."""
        return (self._kept_captures < FREE_CAPTURES
                or self._kept_replays >= REPLAYS_PER_CAPTURE * self._kept_captures)

    def _capture(self, key: tuple, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> Any:
        """A new graph of this copy, kept under ``key`` (None: capturing failed, graphs are off)."""
        graph = self._graph_of(targets, sources)
        if graph is None:
            return None
        if len(self._graphs) >= MAX_GRAPHS:
            self._graphs.clear()
            self._kept_captures = self._kept_replays = 0
        self._graphs[key] = graph
        self.captured += 1
        self._kept_captures += 1
        return graph

    def _graph_of(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> torch.cuda.CUDAGraph | None:
        """The copy captured as a CUDA graph, on the side stream; on failure graphs are turned off."""
        device = sources[0].device
        main = None
        try:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            main = torch.cuda.current_stream(device)
            torch.cuda.set_stream(self._stream)
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                self.copy_all(targets, sources)
            finally:
                graph.capture_end()
        except Exception as exc:  # noqa: BLE001  (eager copies from now on; the rows are unaffected)
            self.enabled = False
            warnings.warn(f"uhead_vllm: step copies stay eager, capturing them as a CUDA graph failed: {exc}",
                          RuntimeWarning, stacklevel=2)
            return None
        finally:
            if main is not None:
                torch.cuda.set_stream(main)
        return graph
