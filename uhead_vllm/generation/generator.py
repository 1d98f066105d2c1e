"""VllmHiddenStatesGenerator: vLLM outputs plus exact hidden states for every prompt and sample.

One ``generate`` call runs vLLM once with capture on. Rows the engine did not forward because
their KV blocks were prefix-cached are filled from a store keyed like the prefix cache; rows that
are still missing are recomputed with prefix-cache reading skipped (or, in strict mode, reported
as an error). Nothing is ever zero-filled.
"""

from __future__ import annotations

import copy
import itertools
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import numpy as np
import torch

from ..adapters import engine as engine_internals
from ..capture.destination import RowDestination, shared_mark
from ..capture.points import ALIASES
from ..capture.protocol import CapturedRows, RequestTag
from ..errors import CaptureError, MissingRowsError
from .assembly import place_rows
from .backends import Placement, open_capture_client, raise_if_engine_dead
from .host_memory import host_buffer
from .prefix_groups import groups_within_slots, prefix_groups
from .prefix_store import PrefixRowStore, buffer_address, copy_all, held_bytes
from .step_cache import StepCache, StepRecord
from .steering import CAPTURE_CACHE_SALT, SteeredRequest, steer_request, step_key

PromptLike = str | list[dict] | dict

#: Capture tags are unique in the process, so generators sharing one engine never collide.
_TAGS = itertools.count()

_ENGINE_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_ENGINE_LOCKS_GUARD = threading.Lock()


def _physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


@dataclass
class GenerationStats:
    """Counters the caller can read (cumulative on the generator, per call on each result)."""

    tokens_forwarded: int = 0  # rows vLLM actually computed for tagged requests (incl. recompute)
    rows_captured: int = 0  # rows taken from the first pass
    rows_placed: int = 0  # of those, rows the worker wrote into their place while vLLM generated
    rows_written_on_device: int = 0  # of those, rows the GPU wrote into the shared row file itself
    prefix_cache_rows: int = 0  # rows vLLM skipped because their KV was cached
    capture_missed_rows: int = 0  # rows vLLM computed but capture did not record (a defect)
    forwards_seen: int = 0  # model forwards the worker saw during the first pass
    forwards_recorded: int = 0  # of those, forwards whose tagged rows were recorded
    forwards_replayed: int = 0  # of those, forwards whose row copy replayed a CUDA graph (GPU)
    record_seconds: float = 0.0  # worker time on the engine's thread recording rows (first pass)
    place_seconds: float = 0.0  # worker time writing rows into place beside the engine (first pass)
    rows_from_store: int = 0
    rows_from_shared_prefix: int = 0  # prefix-cached prompt rows another request of the call forwarded
    rows_recomputed: int = 0
    recompute_requests: int = 0
    store_evictions: int = 0
    store_stale_drops: int = 0  # stored blocks retired because their rows were changed in place
    # A level, not a count (the cumulative stats keep the latest): bytes of row buffers the
    # generator keeps alive after the call, for the prefix row store and the step cache together.
    held_bytes: int = 0

    def add(self, other: "GenerationStats") -> None:
        for f in fields(self):
            level = f.name == "held_bytes"
            setattr(self, f.name, getattr(other, f.name) + (0 if level else getattr(self, f.name)))


@dataclass
class SampleHiddenStates:
    """Rows for one sample: ``hidden[p]`` is the state after reading ``token_ids[p]``.

    ``token_ids`` = ``prompt_token_ids`` + ``output_token_ids`` exactly as vLLM ran them. The last
    sampled token is never forwarded by vLLM, so ``hidden`` has ``len(token_ids) - 1`` rows unless
    the last token was computed on request (``compute_last_token=True``).

    ``last_row_missing`` is True when the last row was asked for but cannot exist: the sequence
    fills ``max_model_len`` and vLLM refuses to forward a prompt that long. Such a sample keeps
    ``len(token_ids) - 1`` exact rows instead of failing the whole call.

    ``hidden`` is a view into one buffer that holds every sample of the call, shared (not copied)
    with the generator's prefix row store and step cache. Editing it in place is safe but not
    free: the store notices (the buffer's version counter) and recomputes those rows when a later
    call needs them. Clone first to edit rows without that cost.
    """

    prompt_index: int
    sample_index: int
    prompt: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    layers: tuple[int, ...]
    hidden: torch.Tensor  # [rows, L, H]; [rows, L, S * H] for a model of S residual streams
    steps: list[StepRecord] = field(default_factory=list)
    last_row_missing: bool = False
    points: tuple[tuple[str, int], ...] = ()  # (point, decoder layer) of the columns after the layers
    streams: int = 1  # parallel residual streams per token (DeepSeek-V4 mHC: hc_mult)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def layer(self, k: int) -> torch.Tensor:
        """Rows of HF hidden-state index ``k`` as ``[rows, H]``; ``[rows, S, H]`` (every stream, HF's
        layout) for a model of ``S > 1`` residual streams."""
        if k not in self.layers:
            raise KeyError(f"layer {k} was not captured; captured layers: {self.layers}")
        rows = self.hidden[:, self.layers.index(k)]
        return rows if self.streams == 1 else rows.unflatten(-1, (self.streams, -1))

    def point(self, name: str, layer: int) -> torch.Tensor:
        """Rows of capture point ``name`` (e.g. ``"mlp_out"``) of decoder layer ``layer`` as ``[rows, H]``."""
        site = (ALIASES.get(name, name), int(layer))
        if site not in self.points:
            raise KeyError(f"point {name}.{layer} was not captured; captured points: {list(self.points)}")
        return self.hidden[:, len(self.layers) + self.points.index(site)]

    def generated_rows(self) -> torch.Tensor:
        """Rows at the generated tokens' positions that exist (see class docstring)."""
        return self.hidden[self.prompt_len :]


@dataclass
class HiddenStatesGeneration:
    outputs: list[Any]  # vLLM RequestOutput per prompt, ``outputs[i].outputs[s]`` = sample s
    hidden_states: list[list[SampleHiddenStates]]  # [prompt][sample]
    stats: GenerationStats


@dataclass(slots=True)
class _Seq:
    prompt_index: int
    sample: int
    prompt: str
    expected: torch.Tensor  # the sequence's token ids (prompt + output), a view of the call's ids
    ids: np.ndarray  # the same memory as numpy (hashing and checks without a conversion per sequence)
    num_rows: int
    rows: torch.Tensor | None  # set by the first pass: a view of the call's row buffer
    valid: torch.Tensor | None  # set by the first pass
    output: Any  # vLLM CompletionOutput
    request_output: Any
    last: bool = False  # the last token's row is computed (asked for, and the sequence can be forwarded)
    last_row_missing: bool = False  # asked for, but the sequence fills max_model_len
    salt: str = ""  # resolved steering digest: vLLM cache_salt and row-store key prefix ("" = plain)
    steer_args: dict = field(default_factory=dict)  # the resolved steering spec, for a recompute
    step_salt: str = ""  # digest of the spec as given: the step-cache key prefix ("" = plain)


def _invalid_per_seq(valid: torch.Tensor, bounds: np.ndarray) -> np.ndarray:
    """Rows not (yet) valid per sequence, sequence i owning ``valid[bounds[i]:bounds[i + 1]]``:
    one pass over the call's validity instead of a tensor reduction per sequence."""
    missing = np.zeros(valid.numel() + 1, dtype=np.int64)
    np.cumsum(~valid.numpy(), out=missing[1:])
    return missing[bounds[1:]] - missing[bounds[:-1]]


class VllmHiddenStatesGenerator:
    """Generate with vLLM and return exact per-token hidden states of the captured layers.

    ``model`` is a ``vllm.LLM`` built with :func:`uhead_vllm.capture_engine_kwargs` or an
    lm-polygraph ``WhiteboxModelvLLM`` wrapping one. Automatic prefix caching stays on.
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
    ):
        self.whitebox = model if hasattr(model, "model") and hasattr(model, "sampling_params") else None
        self.llm = self.whitebox.model if self.whitebox is not None else model
        self.client = open_capture_client(self.llm)
        self.layers: tuple[int, ...] = tuple(self.client.settings.layers)
        self.points: tuple[tuple[str, int], ...] = tuple(getattr(self.client.settings, "points", ()))
        self.columns = len(self.layers) + len(self.points)  # per row: the layers, then the points
        self.tokenizer = self.llm.get_tokenizer()
        self.block_size = engine_internals.block_size(self.llm)
        self.max_model_len = engine_internals.max_model_len(self.llm)
        self.streams = engine_internals.residual_streams(self.llm)
        # Width of one column of a row: a multi-stream model's streams side by side (S * H).
        self.hidden_size = engine_internals.hidden_size(self.llm) * self.streams
        self.num_decoder_layers = engine_internals.num_decoder_layers(self.llm)  # read once, not per prompt
        self.store = PrefixRowStore(self.block_size, store_max_bytes)
        self.step_cache = StepCache(step_cache_max_idle)
        self.strict = strict
        self.enable_thinking = enable_thinking
        self.compute_last_token = compute_last_token
        self.progress = progress
        self.stats = GenerationStats()

    # ------------------------------------------------------------------ prompts
    def render_prompt(self, prompt: PromptLike, index: int = 0) -> tuple[Any, str]:
        """vLLM input and the prompt text (the step-cache key) for a string, chat or token prompt."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(f"prompt {index} is empty")
            return prompt, prompt
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(m, dict) and "role" in m for m in prompt):
                raise ValueError(f"prompt {index}: a chat must be a non-empty list of role/content dicts")
            text = self.tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True, enable_thinking=self.enable_thinking
            )
            # The template already holds any BOS; token ids keep vLLM from adding it twice.
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return {"prompt_token_ids": ids}, text
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            if not ids:
                raise ValueError(f"prompt {index} has no token ids")
            return {"prompt_token_ids": ids}, self.tokenizer.decode(ids)
        raise TypeError(f"prompt {index}: expected str, chat (list of dicts) or TokensPrompt, "
                        f"got {type(prompt).__name__}")

    def _pretokenized(self, rendered: list[tuple[Any, str]]) -> list[tuple[Any, str]]:
        """Text prompts as token ids, tokenized once per prompt here as vLLM tokenizes text (the
        same tokenizer, its special tokens added), so vLLM does not tokenize every sample's request
        again: each sample is a request of its own, and at 64 prompts x 4 samples that was ~0.1 s
        of a 0.9 s call on an H100 host (experiments/results/gpu/paired-c3527b5/ablate-*). (The
        supported vLLMs truncate prompts only through ``tokenization_kwargs`` of their own
        ``generate``, which this generator does not take.)"""
        texts = [i for i, (vllm_input, _) in enumerate(rendered) if isinstance(vllm_input, str)]
        if not texts:
            return rendered
        ids = self.tokenizer([rendered[i][1] for i in texts])["input_ids"]
        out = list(rendered)
        for i, prompt_ids in zip(texts, ids):
            out[i] = ({"prompt_token_ids": list(prompt_ids)}, rendered[i][1])
        return out

    def _tagged(self, sp: Any, sample: int) -> tuple[Any, int]:
        """A one-sample copy of ``sp`` with its own tag. ``sp`` is already this call's private
        copy: children are shallow copies with their own ``extra_args``, as vLLM makes the
        children of an n>1 request."""
        tag = next(_TAGS)
        child = copy.copy(sp)
        child.n = 1
        # vLLM deep-copies every request's params unless told they are the request's own: these
        # are (the caller's object is never sent), and vLLM's updates of the copy assign fields or
        # add the same stop ids to a set the samples share. Accepting 64 x 4 requests took 71.5 ms
        # with the copies, 31.9 without (plain vLLM's 64 n=4 requests: 26.9; CPU machine,
        # experiments/bench/request_adding.py); on a GPU host the adding overlaps the first steps.
        if hasattr(child, "skip_clone"):
            child.skip_clone = True
        if sp.seed is not None:
            child.seed = sp.seed + sample  # what vLLM does for child i of an n>1 request
        child.extra_args = {**(sp.extra_args or {}), **RequestTag(tag, sample).to_extra_args()}
        return child, tag

    def _steering(self, sp: Any, rendered: tuple[Any, str], index: int) -> SteeredRequest:
        """Prompt ``index``'s request with its steering checked and its cache keys (see steering.py)."""
        settings = self.client.settings
        return steer_request(sp.extra_args, rendered[0], rendered[1], index=index,
                             engine_steers=bool(getattr(settings, "steering", False)),
                             num_layers=self.num_decoder_layers, hidden_size=self.hidden_size,
                             tokenize=lambda text: self.tokenizer(text)["input_ids"])

    # ------------------------------------------------------------------ main entry
    def generate(
        self,
        prompts: Sequence[PromptLike],
        sampling_params: Any | Sequence[Any] | None = None,
        *,
        compute_last_token: bool | None = None,
    ) -> HiddenStatesGeneration:
        """Run vLLM once over ``prompts`` and return outputs with exact hidden states.

        Thread-safe: concurrent calls on one engine (from this or any other generator) are
        serialised by the engine's lock (:func:`engine_lock`), each returning its own rows.
        """
        with engine_lock(self.llm):
            try:
                return self._generate(prompts, sampling_params, compute_last_token)
            except Exception as exc:
                raise_if_engine_dead(exc)
                raise

    def _generate(self, prompts: Sequence[PromptLike], sampling_params: Any, compute_last_token: bool | None
                  ) -> HiddenStatesGeneration:
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
        rendered = self._pretokenized([self.render_prompt(p, i) for i, p in enumerate(prompts)])

        inputs, child_params, owners, steering = [], [], {}, {}
        private: dict[int, Any] = {}  # one deep copy per distinct SamplingParams: the caller's stays untouched
        for i, (rendered_i, sp) in enumerate(zip(rendered, params)):
            if sp.n < 1:
                raise ValueError("SamplingParams.n must be >= 1")
            request = self._steering(sp, rendered_i, i)
            if id(sp) not in private:
                private[id(sp)] = copy.deepcopy(sp)
            sp = private[id(sp)]
            for s in range(sp.n):
                child, tag = self._tagged(sp, s)
                child.extra_args.update(request.extra_args)
                owners[tag] = (i, s)
                steering[tag] = request
                inputs.append(request.vllm_input)
                child_params.append(child)

        placement = self._destination(rendered, owners, child_params, steering)  # drops rows recorded before
        try:
            request_outputs = self.llm.generate(inputs, child_params, use_tqdm=self.progress)
        finally:
            destination = placement.settle()
        rows_ready = self.client.fetch_later()
        # Meanwhile (the worker places its last rows, then answers): what needs no rows.
        seqs = self._sequences(rendered, owners, steering, request_outputs, last)
        keys = self._row_keys(seqs)
        captured = rows_ready()
        if captured.error:
            raise CaptureError(captured.error, outputs=request_outputs)

        stats = GenerationStats(tokens_forwarded=captured.num_rows, rows_captured=captured.num_rows,
                                rows_placed=captured.num_rows if captured.placed else 0)
        self._check_capture_complete(captured, stats, request_outputs)
        lens = np.fromiter((q.num_rows for q in seqs), np.int64, len(seqs))
        stats.rows_from_shared_prefix, valid = self._place_first_pass(seqs, list(owners), lens, captured,
                                                                       destination, rendered)
        bounds = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lens, out=bounds[1:])
        # The final token is never forwarded in context during generation; a row at its position
        # can only be a speculative draft's (possibly after a rejected token), so it is always
        # computed afresh.
        last_rows = [end - 1 for q, end in zip(seqs, bounds[1:].tolist()) if q.last]
        if last_rows:
            valid[last_rows] = False
        invalid = _invalid_per_seq(valid, bounds)
        missing_before = int(invalid.sum()) - len(last_rows)
        stats.prefix_cache_rows = max(0, missing_before + stats.rows_from_shared_prefix - stats.capture_missed_rows)
        evictions, stale = self.store.evictions, self.store.stale_drops
        occupied = self._occupied(seqs)
        try:
            # The store keeps views of this call's rows (no copy), re-pointed to this call's
            # buffer so older ones can be released; sealed once every row is in.
            complete = (invalid == 0).tolist()  # the store's puts leave validity as it was
            for q, k, done in zip(seqs, keys, complete):
                self.store.put(q.expected, q.rows, None if done else q.valid, seal=False, replace=True, keys=k,
                               buffer_bytes=occupied.get(buffer_address(q.rows)))
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            for q, k, done in zip(seqs, keys, complete):
                if not done:
                    stats.rows_from_store += self.store.fill(q.expected, q.rows, q.valid, keys=k, copies=copies)
            copy_all(copies)
            self._recompute_missing(seqs, [q for q, n in zip(seqs, _invalid_per_seq(valid, bounds)) if n], stats)
            for q, k, done in zip(seqs, keys, complete):
                if not done:  # blocks completed by the fill or the recompute
                    self.store.put(q.expected, q.rows, q.valid, seal=False, replace=True, keys=k,
                                   buffer_bytes=occupied.get(buffer_address(q.rows)))
        finally:
            self.store.seal()
        stats.store_evictions = self.store.evictions - evictions
        stats.store_stale_drops = self.store.stale_drops - stale
        result = self._result(prompts, rendered, seqs, stats)
        # The store already counts its buffers; only the step cache's are looked up tensor by tensor.
        stored = self.store.buffer_sizes()
        stats.held_bytes = held_bytes(self.step_cache.tensors(), {**occupied, **stored}, also=stored)
        self.stats.add(stats)
        return result

    # ------------------------------------------------------------------ internals
    def _check_capture_complete(self, captured: CapturedRows, stats: GenerationStats, outputs: list) -> None:
        """Compare what vLLM scheduled for our requests with what the worker recorded.

        Cached prefix tokens are never scheduled, so a shortfall is capture missing forwards
        (e.g. a route that does not run under CUDA-graph replay): an error in strict mode, else
        recomputed and counted, with a warning, never silently.
        """
        expected = int(captured.stats.get("rows_expected", captured.num_rows))
        stats.forwards_seen = int(captured.stats.get("forwards_seen", 0))
        stats.forwards_recorded = int(captured.stats.get("forwards_recorded", 0))
        stats.forwards_replayed = int(captured.stats.get("forwards_replayed", 0))
        stats.record_seconds = float(captured.stats.get("record_seconds", 0.0))
        stats.place_seconds = float(captured.stats.get("place_seconds", 0.0))
        stats.rows_written_on_device = int(captured.stats.get("rows_written_on_device", 0))
        missed = expected - captured.num_rows
        if missed <= 0:
            return
        stats.capture_missed_rows = missed
        message = (
            f"capture missed {missed} of {expected} rows vLLM computed "
            f"({captured.stats.get('forwards_expected', '?')} forwards with our rows, "
            f"{stats.forwards_recorded} recorded); this engine's runner or version is not captured "
            "exactly"
        )
        if self.strict:
            raise CaptureError(f"strict mode: {message}", outputs=outputs)
        warnings.warn(f"{message}; the missing rows are recomputed with a second pass", RuntimeWarning,
                      stacklevel=3)

    def _sequences(self, rendered, owners, steering, request_outputs, last: bool) -> list[_Seq]:
        """One :class:`_Seq` per request (rows and validity come with the first pass); every
        sequence's token ids are views of one array, built in one pass over vLLM's lists."""
        parts = [(ro.prompt_token_ids, ro.outputs[0].token_ids) for ro in request_outputs]
        lens = [len(p) + len(o) for p, o in parts]
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(parts)), np.int64, sum(lens))
        seqs, start = [], 0
        for tag, ro, expected, n in zip(owners, request_outputs, torch.from_numpy(flat).split(lens), lens):
            i, s = owners[tag]
            # vLLM refuses a prompt of max_model_len tokens, so a sequence that long cannot have
            # its last token forwarded: flag it rather than lose the call.
            full = last and n >= self.max_model_len
            num_rows = n - (0 if last and not full else 1)
            ids, start = flat[start : start + n], start + n
            seqs.append(_Seq(i, s, rendered[i][1], expected, ids, num_rows, None, None, ro.outputs[0], ro,
                             last=last and not full, last_row_missing=full,
                             salt=steering[tag].salt, steer_args=steering[tag].extra_args,
                             step_salt=steering[tag].step_salt))
        return seqs

    def _row_keys(self, seqs: list[_Seq]) -> list[list[bytes]]:
        """Every sequence's row-store keys; the full blocks of a prompt are hashed once for all
        the sequences that start with it (the samples of one prompt)."""
        prompts: dict[tuple[str, tuple[int, ...]], list[bytes]] = {}
        keys = []
        for q in seqs:
            prompt = tuple(q.request_output.prompt_token_ids)
            known = prompts.get((q.salt, prompt))
            if known is None:
                known = prompts[(q.salt, prompt)] = self.store.keys(prompt, len(prompt), q.salt.encode())
            keys.append(self.store.keys(q.ids, q.num_rows, q.salt.encode(), known))
        return keys

    def _destination(self, rendered, owners: dict, child_params: list, steering: dict) -> Placement:
        """One buffer with room for every sequence's longest outcome, for the worker to write rows
        into while vLLM generates (see :class:`RowDestination`), requests grouped by the prompt
        prefixes they share (:func:`prefix_groups`); settled once the requests are sent. No
        destination when that room would exceed half the machine's memory even as untouched address
        space, or the backend cannot. Either way the rows the worker recorded before (requests made
        outside this generator) are dropped."""
        ids_of: dict[int, list[int]] = {}  # every prompt reaches vLLM as token ids (see _pretokenized)
        slots, first, tags_of = {}, 0, {}
        for tag, params in zip(owners, child_params):
            i = owners[tag][0]
            ids_of.setdefault(i, rendered[i][0]["prompt_token_ids"])
            new = params.max_tokens if params.max_tokens is not None else self.max_model_len
            capacity = min(len(ids_of[i]) + new, self.max_model_len)
            slots[tag] = (first, capacity)
            first += capacity
            tags_of.setdefault(i, []).append(tag)
        dtype = self.client.settings.torch_dtype
        row_bytes = self.columns * self.hidden_size * dtype.itemsize
        if first * row_bytes > _physical_memory() // 2:
            self.client.fetch()
            return Placement(None)
        shared = prefix_groups([(steering[tags[0]].salt.encode(), ids_of[i], tags) for i, tags in tags_of.items()],
                               self.block_size)
        return self.client.place_into(slots, (first, self.columns, self.hidden_size), groups_within_slots(shared, slots))

    def _place_first_pass(self, seqs: list[_Seq], tags: list[int], lens: np.ndarray, captured: CapturedRows,
                          destination: RowDestination | None, rendered: list[tuple[Any, str]]
                          ) -> tuple[int, torch.Tensor]:
        """Every sequence's rows in one buffer; ``seqs[i]`` is the sequence of request tag ``tags[i]``
        with ``lens[i]`` rows.

        Rows the worker wrote into ``destination`` are only checked (:meth:`_check_placed`);
        otherwise they are copied into a new buffer (:meth:`_copy_captured`). Each sequence's
        ``rows`` / ``valid`` are views of the shared buffers. Returns the rows another request of
        the call wrote (prompt rows of a prefix group) and the validity of every sequence's rows,
        one after another (each ``valid`` is a view of it).
        """
        if destination is not None and captured.num_rows and not captured.placed:
            destination = None  # the worker handed the rows over instead (e.g. it could not map the buffer)
        from_shared = 0
        if destination is not None:
            buffer = destination.buffer
            first = np.fromiter((destination.slots[t][0] for t in tags), np.int64, len(tags))
            capacity = np.fromiter((destination.slots[t][1] for t in tags), np.int64, len(tags))
            from_shared, valid = self._check_placed(seqs, lens, first, capacity, destination.marks, rendered)
        else:
            buffer, valid = self._copy_captured(seqs, tags, captured, lens)
            first, capacity = np.cumsum(lens) - lens, lens
        for q, a, n, c, v in zip(seqs, first.tolist(), lens.tolist(), capacity.tolist(), valid.split(lens.tolist())):
            q.valid = v
            if n <= c:
                q.rows = buffer[a : a + n]
            else:  # vLLM's prompt was longer than the slot planned for it: rows past it are recomputed
                with torch.inference_mode(False):
                    q.rows = torch.empty((n,) + tuple(buffer.shape[1:]), dtype=buffer.dtype)
                q.rows[:c] = buffer[a : a + c]
        return from_shared, valid

    @staticmethod
    def _check_placed(seqs: list[_Seq], lens: np.ndarray, first: np.ndarray, capacity: np.ndarray,
                      marks: np.ndarray, rendered: list[tuple[Any, str]]) -> tuple[int, torch.Tensor]:
        """Which rows in the destination are right: those whose token mark is the sequence's
        token there. The worker wrote the last row forwarded at each place (a position forwarded
        again after a rejected draft counts once, with its final token) and, below a prefix
        group's limit, rows of another member, marked as shared. Those count only where every
        prompt ran as sent (the groups were built from the prompts sent): then the members'
        tokens agree up to the limit and the row is the same computation. Returns the shared rows
        that count and the validity of every sequence's rows."""
        n = np.minimum(lens, capacity)  # rows past a slot were never written
        starts = np.cumsum(n) - n
        checked = np.arange(int(n.sum()))
        expected = np.concatenate([q.ids[:k] for q, k in zip(seqs, n.tolist())])
        found = marks[np.repeat(first - starts, n) + checked]
        shared = found == shared_mark(expected)
        if shared.any() and any(list(q.request_output.prompt_token_ids) != rendered[q.prompt_index][0]["prompt_token_ids"]
                                for q in seqs):
            shared[:] = False  # vLLM ran other prompt ids than the groups were built from
        valid = (found == expected) | shared
        if not (n == lens).all():  # the checked rows among all rows
            valid, checked_rows = np.zeros(int(lens.sum()), dtype=bool), valid
            valid[np.repeat(np.cumsum(lens) - lens - starts, n) + checked] = checked_rows
        with torch.inference_mode(False):  # a normal tensor: written in place later in the call
            return int(shared.sum()), torch.from_numpy(valid)

    def _copy_captured(self, seqs: list[_Seq], tags: list[int], captured: CapturedRows, lens: np.ndarray
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured rows copied into a new buffer, sequence after sequence, with one vectorised
        scatter, and their validity. A captured row counts only where its tag is ours, its position
        lies inside the sequence and its input token equals the sequence's token there; with
        speculative decoding the last matching row forwarded at a position is the one that counts."""
        total = int(lens.sum())
        dtype = captured.hidden_parts[0].dtype if captured.num_rows else self.client.settings.torch_dtype
        buffer = host_buffer((total, self.columns, self.hidden_size), dtype)
        with torch.inference_mode(False):
            valid = torch.zeros(total, dtype=torch.bool)
        if not captured.num_rows or not total:
            return buffer, valid
        n = torch.from_numpy(lens)
        cum = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        cum[1:] = n.cumsum(0)
        seq_tags = torch.tensor(tags, dtype=torch.int64)
        order = torch.argsort(seq_tags)
        slot = torch.searchsorted(seq_tags[order], captured.tags).clamp_(max=len(tags) - 1)
        seq = order[slot]
        pos = captured.positions
        ours = (seq_tags[seq] == captured.tags) & (pos >= 0) & (pos < n[seq])
        row = torch.where(ours, cum[seq] + pos, 0)  # index among all sequences' rows
        expected = torch.cat([q.expected[: q.num_rows] for q in seqs])
        match = ours & (captured.token_ids == expected[row])
        candidates = torch.nonzero(match).flatten()
        last = torch.full((total,), -1, dtype=torch.int64)
        last.scatter_reduce_(0, row[candidates], candidates, reduce="amax")
        hit = last >= 0
        if candidates.numel() == captured.num_rows and int(hit.sum()) == candidates.numel():
            start = 0  # every row used once: one copy, part by part (no concatenation)
            for part in captured.hidden_parts:
                buffer.index_copy_(0, row[start : start + part.shape[0]], part)
                start += part.shape[0]
        else:
            buffer[hit] = captured.hidden[last[hit]]
        return buffer, hit

    @staticmethod
    def _occupied(seqs: list[_Seq]) -> dict[int, int]:
        """Bytes written into each of this call's row buffers (a destination buffer is allocated
        for the longest outcomes; its pages past the rows written are never touched)."""
        occupied: dict[int, int] = {}
        for q in seqs:
            address = buffer_address(q.rows)
            occupied[address] = occupied.get(address, 0) + q.rows.numel() * q.rows.element_size()
        return occupied

    def _place(self, seqs: list[_Seq], captured: CapturedRows, owners: dict) -> None:
        """Recompute pass: place rows into the sequences' buffers from the first pass."""
        by_tag = {t: q for t, q in zip(owners, seqs)}
        if not captured.num_rows:
            return
        order = torch.argsort(captured.tags, stable=True)
        uniq, counts = torch.unique_consecutive(captured.tags[order], return_counts=True)
        start = 0
        for t, c in zip(uniq.tolist(), counts.tolist()):
            idx = order[start : start + c]
            start += c
            q = by_tag.get(t)
            if q is not None:
                place_rows(q.expected, q.num_rows, captured.positions[idx], captured.token_ids[idx],
                           captured.hidden[idx], q.rows, q.valid)

    def _recompute_missing(self, seqs: list[_Seq], todo: list[_Seq], stats: GenerationStats) -> None:
        """Forward again the sequences in ``todo`` (those of ``seqs`` with rows still missing)."""
        from vllm import SamplingParams

        if not todo:
            return
        gaps = [q for q in todo if not bool(q.valid[: q.num_rows - int(q.last)].all())]
        if gaps and self.strict:
            n = sum(int((~q.valid).sum()) for q in gaps)
            raise MissingRowsError(
                f"strict mode: {n} rows of {len(gaps)} sequence(s) were served from vLLM's prefix "
                f"cache and are not in the row store (budget {self.store.max_bytes} bytes, "
                f"{len(self.store)} blocks held); raise store_max_bytes or disable strict mode to "
                "recompute them"
            )
        inputs, params, owners = [], [], {}
        for q in todo:
            tag = next(_TAGS)
            has_gap = not bool(q.valid[: q.num_rows - int(q.last)].all())
            owners[tag] = q
            inputs.append({"prompt_token_ids": q.expected[: q.num_rows].tolist(),
                           "cache_salt": q.salt or CAPTURE_CACHE_SALT})
            params.append(SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=has_gap,
                                         extra_args={**RequestTag(tag, 0).to_extra_args(), **q.steer_args}))
        before = {id(q): int(q.valid.sum()) for q in todo}
        self.llm.generate(inputs, params, use_tqdm=False)
        captured = self.client.fetch()
        if captured.error:  # keep the first pass's outputs, as a first-pass error does
            raise CaptureError(captured.error, outputs=[q.request_output for q in seqs])
        stats.tokens_forwarded += captured.num_rows
        stats.recompute_requests += len(todo)
        self._place(list(owners.values()), captured, owners)
        for q in todo:
            stats.rows_recomputed += int(q.valid.sum()) - before[id(q)]
            if not bool(q.valid.all()):
                missing = torch.nonzero(~q.valid).flatten().tolist()
                raise RuntimeError(f"rows at positions {missing[:10]} could not be computed; this is a bug")

    def _result(self, prompts, rendered, seqs: list[_Seq], stats: GenerationStats) -> HiddenStatesGeneration:
        self.step_cache.begin_call()
        keys = [step_key(q.prompt, q.step_salt) for q in seqs]
        parents = {k: self.step_cache.history_for(k) for k in dict.fromkeys(keys)}  # once per prompt
        hidden: list[list[SampleHiddenStates]] = [[] for _ in prompts]
        merged: list[Any] = [None] * len(prompts)
        # vLLM's outputs of this call's own requests reach no one else: one per prompt becomes
        # its merged output, each sample's completion keeps its object (no copies).
        for q, key in zip(seqs, keys):
            i = q.prompt_index
            out = q.output
            out.index = q.sample
            if merged[i] is None:
                merged[i] = q.request_output
                merged[i].outputs = []
                if isinstance(prompts[i], str):  # sent as token ids (see _pretokenized): the text, as vLLM gives it
                    merged[i].prompt = prompts[i]
            merged[i].outputs.append(out)
            prompt_ids = list(q.request_output.prompt_token_ids)
            sample = SampleHiddenStates(
                prompt_index=i, sample_index=q.sample, prompt=q.prompt, prompt_token_ids=prompt_ids,
                output_token_ids=list(q.output.token_ids), text=q.output.text, layers=self.layers,
                hidden=q.rows, last_row_missing=q.last_row_missing, points=self.points, streams=self.streams,
            )
            record = StepRecord(text=q.output.text, token_ids=sample.output_token_ids,
                                hidden=q.rows[len(prompt_ids):])  # a view; compacted if continued
            sample.steps = self.step_cache.extend(key, record, parents[key])
            hidden[i].append(sample)
        return HiddenStatesGeneration(outputs=merged, hidden_states=hidden, stats=stats)

    # ------------------------------------------------------------------ multi-step control
    def reset_hs_step_cache(self, reset_prefix_cache: bool = True) -> None:
        """Start a new multi-step loop: forget trajectories (and vLLM's prefix cache if asked)."""
        with engine_lock(self.llm):  # never while another thread's requests run
            self.step_cache.clear()
            if reset_prefix_cache:
                if not self.llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
                self.store.clear()
