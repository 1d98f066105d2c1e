"""VllmHiddenStatesGenerator: vLLM outputs plus exact hidden states for every prompt and sample.

One ``generate`` call runs vLLM once with capture on, in stages, each a module that says what it
needs and produces: the plan (plan.py: one request per sample), the sequences of vLLM's outputs
(sequences.py), the first pass's rows placed and checked (first_pass.py), the completion of
missing rows from the store or by a recompute (completion.py) and the results (results.py). Rows
the engine did not forward because their KV blocks were prefix-cached are filled from a store
keyed like the prefix cache; rows that are still missing are recomputed with prefix-cache reading
skipped (or, in strict mode, reported as an error). Nothing is ever zero-filled.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence, cast

import numpy as np

from ..adapters import engine as engine_internals
from ..capture.protocol import CapturedRows
from ..errors import CaptureError
from .backends import CaptureClient, open_capture_client, raise_if_engine_dead
from .completion import Recompute, RowCompletion, missing_rows
from .first_pass import check_capture_complete, place_first_pass, request_destination
from .plan import PromptLike, Rendered, Window, next_tag, plan_call, pretokenized, render_prompt, window_start
from .prefix_store import held_bytes
from .results import GenerationStats, HiddenStatesGeneration, SampleHiddenStates, collect
from .sequences import occupied as occupied_bytes
from .sequences import sequences, set_row_keys
from .shared_prompt import shared_rows, store_straddling_blocks
from .step_cache import StepCache
from .steering import SteeredRequest, steer_request

__all__ = ["GenerationStats", "HiddenStatesGeneration", "PromptLike", "SampleHiddenStates",
           "VllmHiddenStatesGenerator", "engine_lock"]

_ENGINE_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_ENGINE_LOCKS_GUARD = threading.Lock()


def engine_lock(llm: Any) -> threading.RLock:
    """The one lock of ``llm``, shared by every generator on it.

    ``vllm.LLM`` is not thread-safe (two threads stepping one engine crash it or take each other's
    outputs), and a call drains every row the worker recorded; so calls on one engine take turns.
    """
    with _ENGINE_LOCKS_GUARD:
        lock = _ENGINE_LOCKS.get(llm)
        if lock is None:
            lock = _ENGINE_LOCKS[llm] = threading.RLock()
        return lock


class VllmHiddenStatesGenerator:
    """Generate with vLLM and return exact per-token hidden states of the captured layers.

    ``model`` is a ``vllm.LLM`` built with :func:`uhead_vllm.capture_engine_kwargs` or an
    lm-polygraph ``WhiteboxModelvLLM`` wrapping one. Automatic prefix caching stays on. A prompt
    dict's ``cache_salt`` keeps its KV blocks, stored rows and steps apart, as vLLM's isolation.

    ``window`` (also per call) chooses the rows each sample captures: ``"all"`` (every position,
    the default), ``"generated"`` (the generated tokens' positions) or an int k (the last k prompt
    positions, then the generated ones). Rows outside a window are never recorded nor copied off
    the device, filled from the row store nor recomputed; a sample's ``first_row`` says where its
    rows begin.
    """

    def __init__(
        self,
        model: Any,
        *,
        store_max_bytes: int = 4 << 30,
        strict: bool = False,
        enable_thinking: bool = False,
        compute_last_token: bool = False,
        step_cache_max_idle: int = 2,
        progress: bool = False,
        window: Window = "all",
    ):
        window_start(window, 0)  # refuse a bad window here, not at the first call
        self.whitebox = model if hasattr(model, "model") and hasattr(model, "sampling_params") else None
        self.llm = self.whitebox.model if self.whitebox is not None else model
        self.client = cast(CaptureClient, open_capture_client(self.llm))  # sync face; raises on a dead engine
        self.layers: tuple[int, ...] = tuple(self.client.settings.layers)
        self.points: tuple[tuple[str, int], ...] = tuple(getattr(self.client.settings, "points", ()))
        self.columns = len(self.layers) + len(self.points)  # per row: the layers, then the points
        self.tokenizer = self.llm.get_tokenizer()
        self.block_size = engine_internals.block_size(self.llm)
        self.max_model_len = engine_internals.max_model_len(self.llm)
        self.streams = engine_internals.residual_streams(self.llm)
        # A model state's width: a multi-stream model's streams side by side (S * H).
        self.model_width = engine_internals.hidden_size(self.llm) * self.streams
        # Width of one column of a row: the model's, or where the worker reduces rows to a head's
        # inputs (token_inputs) one column of D, as the worker reports it.
        self.reduced = bool(getattr(self.client.settings, "token_inputs", ""))
        self.columns = 1 if self.reduced else self.columns
        self.hidden_size = int(cast(Any, self.client).status()["hidden_size"]) if self.reduced else self.model_width
        self.num_decoder_layers = engine_internals.num_decoder_layers(self.llm)  # read once, not per prompt
        self.completion = RowCompletion(self.block_size, store_max_bytes, next_tag)
        self.store = self.completion.store
        self.step_cache = StepCache(step_cache_max_idle)
        self.strict = strict
        self.enable_thinking = enable_thinking
        self.compute_last_token = compute_last_token
        self.window = window
        self.progress = progress
        self.stats = GenerationStats()

    # ------------------------------------------------------------------ prompts
    def render_prompt(self, prompt: PromptLike, index: int = 0) -> Rendered:
        """vLLM input and the prompt text (the step-cache key) for a string, chat or token prompt."""
        return render_prompt(self.tokenizer, prompt, index, self.enable_thinking)

    def _steering(self, sp: Any, rendered: Rendered, index: int) -> SteeredRequest:
        """Prompt ``index``'s request with its steering checked and its cache keys (see steering.py)."""
        return steer_request(sp.extra_args, rendered[0], rendered[1], index=index,
                             engine_steers=bool(getattr(self.client.settings, "steering", False)),
                             num_layers=self.num_decoder_layers, hidden_size=self.model_width,
                             tokenize=lambda text: self.tokenizer(text)["input_ids"])

    # ------------------------------------------------------------------ main entry
    def generate(
        self,
        prompts: Sequence[PromptLike],
        sampling_params: Any | Sequence[Any] | None = None,
        *,
        compute_last_token: bool | None = None,
        window: Window | None = None,
    ) -> HiddenStatesGeneration:
        """Run vLLM once over ``prompts`` and return outputs with exact hidden states of each
        sample's capture ``window`` (None: the generator's; see the class docstring).

        Thread-safe: concurrent calls on one engine (from this or any other generator) are
        serialised by the engine's lock (:func:`engine_lock`), each returning its own rows.
        """
        with engine_lock(self.llm):
            try:
                return self._generate(prompts, sampling_params, compute_last_token,
                                      self.window if window is None else window)
            except Exception as exc:
                raise_if_engine_dead(exc)
                raise

    def _generate(self, prompts: Sequence[PromptLike], sampling_params: Any, compute_last_token: bool | None,
                  window: Window) -> HiddenStatesGeneration:
        from vllm import SamplingParams

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        if sampling_params is None:
            sampling_params = self.whitebox.sampling_params if self.whitebox else SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        last = self.compute_last_token if compute_last_token is None else compute_last_token
        rendered = pretokenized(self.tokenizer, [self.render_prompt(p, i) for i, p in enumerate(prompts)])
        plan = plan_call(prompts, rendered, params, last, self._steering, window)

        # First pass: the worker writes rows into place while vLLM generates (where it can).
        placement = request_destination(self.client, plan, max_model_len=self.max_model_len, columns=self.columns,
                                        hidden_size=self.hidden_size, block_size=self.block_size)
        try:
            request_outputs = self.llm.generate([r.vllm_input for r in plan.requests],
                                                [r.params for r in plan.requests], use_tqdm=self.progress)
        finally:
            destination = placement.settle()
        rows_ready = self.client.fetch_later()
        # Meanwhile (the worker places its last rows, then answers): what needs no rows.
        seqs = sequences(plan, request_outputs, self.max_model_len)
        set_row_keys(seqs, self.store)
        captured = rows_ready()
        if captured.error:
            raise CaptureError(captured.error, outputs=request_outputs)

        skipped = int(captured.stats.get("rows_skipped", 0))
        stats = GenerationStats(tokens_forwarded=captured.num_rows + skipped, rows_captured=captured.num_rows,
                                rows_placed=captured.num_rows if captured.placed else 0, rows_skipped=skipped,
                                bytes_to_host=int(captured.stats.get("bytes_to_host", 0)))
        check_capture_complete(captured, stats, self.strict, request_outputs)
        lens = np.fromiter((q.num_rows for q in seqs), np.int64, len(seqs))
        stats.rows_from_shared_prefix, valid = place_first_pass(
            seqs, [r.tag for r in plan.requests], lens, captured, destination, plan, self.columns,
            self.hidden_size, self.client.settings.torch_dtype)
        bounds = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lens, out=bounds[1:])
        # The final token is never forwarded in context during generation; a row at its position
        # can only be a speculative draft's (possibly after a rejected token), so it is always
        # computed afresh.
        last_rows = [end - 1 for q, end in zip(seqs, bounds[1:].tolist()) if q.last]
        if last_rows:
            valid[last_rows] = False
        # Rows of the capture windows only (a window's last row is the last token's when asked for).
        in_windows = sum(1 for q in seqs if q.last and q.num_rows > q.need_from)
        missing_before = int(missing_rows(seqs, (valid, bounds)).sum()) - in_windows
        stats.prefix_cache_rows = max(0, missing_before + stats.rows_from_shared_prefix - stats.capture_missed_rows)

        # Completion: gaps from the store, the rest recomputed in one more pass.
        evictions, stale = self.store.evictions, self.store.stale_drops
        occupied = occupied_bytes(seqs)
        done = self.completion.complete(seqs, lambda requests: self._forward(requests, request_outputs),
                                        strict=self.strict, joint=(valid, bounds), occupied=occupied)
        stats.rows_from_store, stats.rows_recomputed = done.rows_from_store, done.rows_recomputed
        stats.recompute_requests = done.recompute_requests
        stats.tokens_forwarded += done.rows_forwarded + done.rows_skipped
        stats.rows_skipped += done.rows_skipped
        stats.bytes_to_host += done.bytes_to_host
        store_straddling_blocks(seqs, self.store)
        stats.rows_shared = shared_rows(seqs)
        stats.store_evictions = self.store.evictions - evictions
        stats.store_stale_drops = self.store.stale_drops - stale

        result = collect(plan, seqs, self.step_cache, stats, self.layers, self.points, self.streams, self.reduced)
        # The store already counts its buffers; only the step cache's are looked up tensor by tensor.
        stored = self.store.buffer_sizes()
        stats.held_bytes = held_bytes(self.step_cache.tensors(), {**occupied, **stored}, also=stored)
        self.stats.add(stats)
        return result

    def _forward(self, requests: list[Recompute], first_outputs: list[Any]) -> CapturedRows:
        """The recompute pass: run ``requests`` on the engine, take back their rows."""
        self.llm.generate([r.prompt for r in requests], [r.params for r in requests], use_tqdm=False)
        captured = self.client.fetch()
        if captured.error:  # keep the first pass's outputs, as a first-pass error does
            raise CaptureError(captured.error, outputs=first_outputs)
        return captured

    # ------------------------------------------------------------------ multi-step control
    def reset_hs_step_cache(self, reset_prefix_cache: bool = True) -> None:
        """Start a new multi-step loop: forget trajectories (and vLLM's prefix cache if asked)."""
        with engine_lock(self.llm):  # never while another thread's requests run
            self.step_cache.clear()
            if reset_prefix_cache:
                if not self.llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
                self.store.clear()
