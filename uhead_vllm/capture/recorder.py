"""Per-step recording of tagged requests' rows, inside the worker.

The runner adapter hands the recorder each step's schedule (which requests are new, how many
tokens each gets) and, after the forward, the step's outputs. Per step the recorder gathers the
tagged rows on the device (a slice per contiguous run of tagged requests, usually one); nothing on
the hot path waits for the device. When the engine side gave a :class:`RowDestination` (its own
tensor in this process, or a shared-memory file), steps collect in a device buffer and reach the
destination a batch at a time during the generation (step_batch.py), each row with its input
token: they go to pinned memory and the placer writes them (placer.py), or, where the engine asks
for it, the device writes them into the registered row file itself (file_writer.py); only their
count is kept. Without one, each
step is copied to pinned memory asynchronously and kept. ``take`` waits once and assembles one
:class:`CapturedRows`.

Counters say what happened, separately: forwards seen, forwards that had tagged rows scheduled,
forwards recorded, rows scheduled for tagged requests and rows recorded. A difference between the
last two means capture missed rows (never the prefix cache: cached tokens are not scheduled).
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..adapters import ScheduledStep, StepOutputs
from .file_writer import FileWriter
from .placer import ChunkSlots, Placer
from .staging import PinnedArena, PinnedRing
from .step_batch import WRITER_BUFFER_BYTES, StepBatcher
from .protocol import CapturedRows, CaptureSettings, RequestTag, RowDestination, empty_rows


#: Pinned staging memory for steps the placer consumes: 40 decode steps of 256 requests x 3 layers
#: of an 8B model in bf16, so a placer a few steps behind is no cost. A step larger than a quarter
#: of it (a long prefill) gets pinned memory of its own: in the ring it left the following decode
#: steps no room until placed, and each of them then paid a 7 ms pinned allocation (bench_recorder).
STAGING_BYTES = 256 << 20
#: Pinned memory per chunk for the metadata steps keep until the take (16 bytes per row).
METADATA_CHUNK_BYTES = 4 << 20
_UNKNOWN = object()  # a request id the recorder never saw


@dataclass
class _Step:
    tags: np.ndarray  # [C] per chunk (one chunk per tagged request in the step)
    samples: np.ndarray  # [C]
    lens: np.ndarray  # [C] rows per chunk
    hidden: torch.Tensor  # [R, L, H] host (pinned when the step ran on a GPU)
    meta: torch.Tensor  # [2, R] int64 host: positions, input token ids


@dataclass
class _Batch:
    """Per-request capture facts of one batch (row order of a forward), as arrays, so a step is
    numpy index math instead of a Python loop over requests. Decode steps repeat the same batch,
    so it is built once and reused until the requests or their tags change."""

    req_ids: list[str]
    tagged: np.ndarray  # [K] indices (into the batch) of tagged requests
    tags: np.ndarray  # [K]
    samples: np.ndarray  # [K]
    first: np.ndarray  # [K] first row of the tag's slot in the destination (-1: none)
    capacity: np.ndarray  # [K] rows of that slot
    group_row: np.ndarray | None  # [K] row of the destination's group tables (None: no groups)

    _layout: "_Layout | None" = None  # the last forward's row layout (decode steps repeat it)

    def layout(self, qsl: np.ndarray) -> "_Layout | None":
        """Where this forward's tagged rows are (None: no tagged request has rows in it), reused
        while the token counts per request (``qsl``, host) stay those of the last forward."""
        key = qsl.tobytes()
        if self._layout is None or self._layout.key != key:
            self._layout = _Layout.of(self, qsl, key)
        return self._layout if self._layout.n_rows else None


@dataclass
class _Layout:
    """One forward's tagged rows: the chunks (one per tagged request with rows), their facts for
    the placer, and the row ranges to gather. Built once per batch and token counts, so a decode
    step of a steady batch costs no index arithmetic."""

    key: bytes  # the forward's query_start_loc, as bytes
    tags: np.ndarray  # [C]
    samples: np.ndarray  # [C]
    slots: ChunkSlots  # where the chunks go in the destination, with their rows per chunk
    runs: list[tuple[int, int]]  # row ranges of the forward to gather (adjacent chunks merged)
    n_rows: int

    @property
    def lens(self) -> np.ndarray:
        """[C] rows per chunk."""
        return self.slots.lens

    @classmethod
    def of(cls, batch: _Batch, qsl: np.ndarray, key: bytes) -> "_Layout":
        scheduled = (qsl[batch.tagged + 1] > qsl[batch.tagged]).nonzero()[0]  # chunks with rows
        chunk_req = batch.tagged[scheduled]
        starts, ends = qsl[chunk_req].astype(np.int64), qsl[chunk_req + 1].astype(np.int64)
        lens = ends - starts
        rows = None if batch.group_row is None else batch.group_row[scheduled]
        return cls(key, batch.tags[scheduled], batch.samples[scheduled],
                   ChunkSlots(batch.first[scheduled], batch.capacity[scheduled], lens, rows),
                   _runs(starts, ends) if scheduled.size else [], int(lens.sum()))


@dataclass
class RowRecorder:
    """Accumulates captured steps until the engine fetches them."""

    settings: CaptureSettings
    aux_layers: tuple[int, ...]  # the layers the model emits, sorted (vLLM sorts them)
    hidden_size: int
    steps: list[_Step] = field(default_factory=list)
    bytes_held: int = 0
    error: str | None = None
    forwards_seen: int = 0
    forwards_expected: int = 0  # forwards with rows of tagged requests scheduled
    forwards_recorded: int = 0
    rows_expected: int = 0  # rows of tagged requests vLLM scheduled (so computed)
    rows_recorded: int = 0
    chunks_recorded: int = 0  # (request, forward) pairs recorded: with accepted drafts, fewer than tokens
    scheduled_rows: int = 0  # tagged rows scheduled in the step that is running now
    rows_placed: int = 0  # rows sent to the destination (this generation)
    rows_written_on_device: int = 0  # of those, rows the device wrote into the row file itself
    _tags: dict[str, RequestTag | None] = field(default_factory=dict)
    _untagged: int = 0  # live requests in ``_tags`` without a tag
    _owner: dict[tuple[int, int], str] = field(default_factory=dict)
    _copied: object = None  # CUDA event after the last device-to-host copy
    _copy_stream: object = None  # CUDA stream of the device-to-host copies
    _batch: _Batch | None = None  # the last forward's batch facts (None: rebuild)
    record_seconds: float = 0.0  # host time the engine's thread spent in the recorder (this generation)
    destination: RowDestination | None = None  # rows go here during the generation
    _writer: FileWriter | None = None  # the destination's row file as the device writes it (or None)
    _placer: Placer = field(default_factory=Placer)
    _batcher: StepBatcher | None = None  # placed steps' rows on their way to the host, a batch at a time
    # One batcher per way, by whether the device writes the rows. ``_batcher`` is this generation's,
    # kept as state: a writer that fails mid-call hands the rest to the placer (``_writer`` becomes
    # None) while the call's batcher stays.
    _batchers: dict[bool, StepBatcher] = field(default_factory=dict)
    _staging: PinnedRing | None = None  # pinned memory for steps on their way to the placer (GPU)
    _arena: PinnedArena | None = None  # pinned memory for the metadata of placed steps (GPU)

    def __post_init__(self) -> None:
        # Map requested layer order onto the (sorted) aux output order.
        self._select = [self.aux_layers.index(k) for k in self.settings.layers]

    # ------------------------------------------------------------------ schedule
    def on_schedule(self, step: ScheduledStep) -> None:
        start = time.perf_counter()
        try:
            self._schedule(step)
        finally:
            self.record_seconds += time.perf_counter() - start

    def _schedule(self, step: ScheduledStep) -> None:
        if step.new_requests or step.finished_req_ids:
            self._batch = None
        for rid in step.finished_req_ids:
            tag = self._tags.pop(rid, _UNKNOWN)
            if tag is None:
                self._untagged -= 1
            elif tag is not _UNKNOWN and self._owner.get((tag.tag, tag.sample)) == rid:
                del self._owner[(tag.tag, tag.sample)]
        for rid, extra_args in step.new_requests:
            self._register(rid, extra_args)
        tags, scheduled = self._tags, step.num_scheduled_tokens
        if not self._untagged and scheduled.keys() <= tags.keys():
            rows = sum(scheduled.values())  # every request is captured: no lookup per request
        elif self._untagged == len(tags):
            rows = 0  # no live request is captured (plain traffic on a capturing engine)
        else:
            rows = sum(n for rid, n in scheduled.items() if tags.get(rid) is not None)
        self.scheduled_rows = rows
        if rows:
            self.forwards_expected += 1
            self.rows_expected += rows

    def _register(self, req_id: str, extra_args: dict | None) -> None:
        tag = RequestTag.from_extra_args(extra_args)
        if self._tags.get(req_id, _UNKNOWN) is None:
            self._untagged -= 1  # registered again (a request id reused)
        self._tags[req_id] = tag
        if tag is None:
            self._untagged += 1
            return
        key = (tag.tag, tag.sample)
        other = self._owner.get(key)
        if other is not None and other != req_id and self.error is None:
            self.error = (
                f"requests {other!r} and {req_id!r} carry the same capture tag {key}: "
                "sampling with n>1 must go through VllmHiddenStatesGenerator, which gives "
                "every sample its own tag"
            )
        self._owner[key] = req_id

    def fail(self, message: str) -> None:
        """Report a problem to the engine side with the next fetch (the first one wins)."""
        if self.error is None:
            self.error = message

    # ------------------------------------------------------------------ forward
    def on_forward(self, step: StepOutputs, streams: list[torch.Tensor] | None = None,
                   points: list[torch.Tensor] | None = None) -> None:
        """Record the tagged rows of one forward. ``streams`` (layer-hook route) replace
        ``step.aux``; both are in sorted HF-index order. ``points`` are the sublayer sites'
        values in ``settings.points`` order (columns after the layers)."""
        start = time.perf_counter()
        try:
            self._record(step, streams, points)
        finally:
            self.record_seconds += time.perf_counter() - start

    def _record(self, step: StepOutputs, streams: list[torch.Tensor] | None,
                points: list[torch.Tensor] | None) -> None:
        self.forwards_seen += 1
        source = step.aux if streams is None else streams
        if self.error is not None or not self.scheduled_rows or not source:
            return
        if len(points or ()) != len(self.settings.points):
            self.error = (f"capture points: {len(points or ())} of {len(self.settings.points)} hooks fired in "
                          "this forward (a submodule was skipped or compiled); no rows were recorded")
            return
        layout = self._batch_facts(step.req_ids).layout(step.query_start_loc)
        if layout is None:
            return
        n_rows = layout.n_rows
        dtype = self.settings.torch_dtype
        new_bytes = n_rows * self.settings.num_columns * self.hidden_size * dtype.itemsize
        if self.bytes_held + new_bytes > self.settings.max_bytes:
            self.error = (
                f"capture memory budget exceeded: holding {self.bytes_held} bytes, this forward "
                f"adds {new_bytes}, budget max_bytes={self.settings.max_bytes}. Raise max_bytes, "
                "capture fewer layers or use bfloat16, or generate in smaller batches"
            )
            self.steps.clear()
            self.bytes_held = 0
            if self._batcher is not None:
                self._batcher.discard()
            return
        picked = [source[j] for j in self._select] + list(points or ())
        positions = step.positions[0] if step.positions.dim() > 1 else step.positions  # M-RoPE: text row
        runs = layout.runs
        if self.destination is not None:
            if self._batcher is None:
                writes = self._writer is not None
                self._batcher = self._batchers[writes] = StepBatcher(
                    self.settings.num_columns, self.hidden_size, dtype, self._ship, WRITER_BUFFER_BYTES if writes else None)
            if self._batcher.fits(n_rows):
                self._batcher.add(layout.slots, picked, positions, step.input_ids, runs, n_rows)
            else:  # larger than a batch buffer (a long prefill): shipped on its own, after the batch
                self._batcher.flush()
                self._ship([(layout.slots, n_rows)], *_gathered(picked, positions, step.input_ids, runs, dtype))
        else:  # kept until fetched
            hidden, meta = _gathered(picked, positions, step.input_ids, runs, dtype)
            hidden, meta, _, _ = self._to_host(hidden, meta)
            self.steps.append(_Step(layout.tags, layout.samples, layout.lens, hidden, meta))
            self.bytes_held += new_bytes
        self.forwards_recorded += 1
        self.rows_recorded += n_rows
        self.chunks_recorded += len(layout.lens)

    def _batch_facts(self, req_ids: list[str]) -> _Batch:
        """This forward's per-request facts, reused while the batch stays the same."""
        batch = self._batch
        if batch is not None and batch.req_ids == req_ids:
            return batch
        found = [(i, tag) for i, tag in enumerate(map(self._tags.get, req_ids)) if tag is not None]
        tags = np.asarray([t.tag for _, t in found], dtype=np.int64)
        dest = self.destination
        slots = dest.slots if dest is not None else {}
        where = [slots.get(t.tag, (-1, 0)) for _, t in found]
        group_row = None
        if dest is not None and dest.groups:  # -1: the tables' "no group" row
            group_row = np.asarray([dest.group_row.get(t.tag, -1) for _, t in found], dtype=np.int64)
        self._batch = _Batch(
            req_ids=list(req_ids), tagged=np.asarray([i for i, _ in found], dtype=np.int64), tags=tags,
            samples=np.asarray([t.sample for _, t in found], dtype=np.int64),
            first=np.asarray([a for a, _ in where], dtype=np.int64),
            capacity=np.asarray([n for _, n in where], dtype=np.int64),
            group_row=group_row)
        return self._batch

    def _ship(self, steps: list[tuple[ChunkSlots, int]], hidden: torch.Tensor, meta: torch.Tensor) -> object:
        """Send consecutive steps' rows [R, C, H] and metadata [2, R] to the destination as one:
        written there by the device (with a file writer) or copied to the host for the placer.
        Only their count is kept until the take. Returns the CUDA event after which ``hidden``
        and ``meta`` may be overwritten (None on CPU: at once)."""
        slots = [chunks for chunks, _ in steps]
        chunks = slots[0] if len(slots) == 1 else ChunkSlots.joined(slots)
        n_rows = sum(n for _, n in steps)
        self.rows_placed += n_rows
        if self._writer is not None:
            try:
                event = self._write_file(chunks, hidden, meta)
            except Exception as exc:  # noqa: BLE001  (the placer writes these rows and the rest instead)
                self._writer = None
                warnings.warn(f"uhead_vllm: the device could not write the row file, the host placer takes over: "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
            else:
                self.rows_written_on_device += n_rows
                return event
        host_hidden, host_meta, ready, release = self._to_host(hidden, meta)
        self._placer.submit(ready, self.destination, host_hidden, host_meta, chunks, release)
        return ready

    def _write_file(self, chunks: ChunkSlots, hidden: torch.Tensor, meta: torch.Tensor) -> object:
        """The device writes the rows into the registered row file, on the copy stream (the host
        only sends each row's slot, 16 bytes); prompt rows of prefix groups are then fanned out
        by the placer from the file, once the writes are done."""
        dest = self.destination
        places = np.stack(chunks.per_row())
        if hidden.device.type != "cuda":
            self._writer.write(hidden, meta, *torch.from_numpy(places))
            if dest.groups:
                self._placer.submit(None, dest, None, meta, chunks)
            return None
        stream, main = self._streams(hidden.device)
        host_places = self._metadata_arena().host_copy(torch.empty(places.shape, dtype=torch.int64, device="meta"))
        host_places.numpy()[...] = places
        torch.cuda.set_stream(stream)
        try:
            slot_first, capacity = host_places.to(hidden.device, non_blocking=True)
            self._writer.write(hidden, meta, slot_first, capacity)
            host_meta = None
            if dest.groups:
                host_meta = self._metadata_arena().host_copy(meta)
                host_meta.copy_(meta, non_blocking=True)
            for t in (hidden, meta):
                t.record_stream(stream)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        finally:
            torch.cuda.set_stream(main)
        self._copied = event
        if host_meta is not None:
            self._placer.submit(event, dest, None, host_meta, chunks)
        return event

    def _metadata_arena(self) -> PinnedArena:
        """The pinned arena for placed steps' host-side metadata (made at first use, reset at the take)."""
        if self._arena is None:
            self._arena = PinnedArena(METADATA_CHUNK_BYTES)
        return self._arena

    def _streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The copy stream, made to wait for what the main stream queued so far, and the main stream."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=device)
        main = torch.cuda.current_stream(self._copy_stream.device_index)
        self._copy_stream.wait_stream(main)  # the gathers that made the rows
        return self._copy_stream, main

    def _to_host(self, hidden: torch.Tensor, meta: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, object, Callable[[], None] | None]:
        """Host copies of a step's freshly gathered rows and metadata; on a GPU asynchronous into
        pinned memory, on a stream of its own (one wait, one event for both), so the next step's
        forward never queues behind the copies; the third value is the copies' event (None on
        CPU). With a destination the rows go through the placer's ring (the fourth value frees
        their region once placed; None: nothing to free) and the metadata (positions and tokens
        for the placer) into the arena, freed at the take (see staging.py)."""
        if hidden.device.type != "cuda":
            return hidden, meta, None, None  # already new tensors (stack/cat copies), never engine buffers
        stream, main = self._streams(hidden.device)
        staged = release = None
        if self.destination is not None:
            if self._staging is None:
                self._staging = PinnedRing(STAGING_BYTES)
            if hidden.numel() * hidden.element_size() <= STAGING_BYTES // 4:
                staged = self._staging.host_copy(hidden)
            host_meta = self._metadata_arena().host_copy(meta)
        else:  # rows and metadata kept until fetched, in memory of their own
            host_meta = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True)
        if staged is not None:
            host_hidden, end = staged
            release = functools.partial(self._staging.release, end)
        else:  # no destination, a step too large for the ring, or no room in it
            host_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
        # torch.cuda.stream(...) looks the device and both streams up again (~40 us a step at 256
        # requests on an H100 host, bench_recorder): switch by hand, as vLLM's own copies do.
        torch.cuda.set_stream(stream)
        try:
            for host, t in ((host_hidden, hidden), (host_meta, meta)):
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the allocator must not hand ``t`` out before the copy ran
            # A blocking event: the placer thread waiting on it sleeps instead of spinning in the
            # driver beside the engine thread's launches.
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        finally:
            torch.cuda.set_stream(main)
        self._copied = event
        return host_hidden, host_meta, event, release

    # ------------------------------------------------------------------ fetch
    def place_into(self, destination: RowDestination | None, writer: FileWriter | None = None) -> None:
        """Write the rows of the coming generation into ``destination`` (until the next ``take``);
        with ``writer`` (the destination's row file as the device sees it) the device writes them."""
        if self.steps or self.rows_placed or any(b.pending for b in self._batchers.values()):
            raise RuntimeError("rows of an earlier generation are still held: take them first")
        if writer is not None and destination is None:
            raise ValueError("a file writer needs the destination it writes")
        self.destination, self._writer = destination, writer
        self._batch = None  # its slots are the destination's
        # Each way keeps its batcher (buffers and step graphs), so calls alternating ways stay warm.
        self._batcher = self._batchers.get(writer is not None)

    def take(self) -> CapturedRows:
        """Hand over everything recorded so far and start afresh."""
        if self._batcher is not None:
            self._batcher.flush()
        placing_error, place_seconds = self._placer.drain()
        if self._copied is not None:
            self._copied.synchronize()  # type: ignore[attr-defined]
            self._copied = None
        replayed = self._batcher.take_replayed() if self._batcher is not None else 0
        stats = {"forwards_seen": self.forwards_seen, "forwards_expected": self.forwards_expected,
                 "forwards_replayed": replayed,
                 "forwards_recorded": self.forwards_recorded, "rows_expected": self.rows_expected,
                 "rows_recorded": self.rows_recorded, "chunks_recorded": self.chunks_recorded, "bytes": self.bytes_held,
                 "record_seconds": round(self.record_seconds, 6), "place_seconds": round(place_seconds, 6),
                 "rows_written_on_device": self.rows_written_on_device}
        if self.destination is not None:
            rows = CapturedRows.placed_into_destination(tuple(self.settings.layers), self.rows_placed)
        else:
            rows = self._rows(self.steps)  # new tensors: the arena's metadata memory is free again
        if self._arena is not None:
            self._arena.reset()
        rows.error = self.error or placing_error
        rows.stats = stats
        self.steps = []
        self.bytes_held = self.rows_placed = self.rows_written_on_device = 0
        self.error = None
        self.destination, self._writer = None, None
        self.forwards_seen = self.forwards_expected = self.forwards_recorded = 0
        self.record_seconds = 0.0
        self.rows_expected = self.rows_recorded = self.chunks_recorded = 0
        return rows

    def take_tags(self, tags: list[int], forget: bool = False) -> CapturedRows:
        """Hand over only the rows of ``tags`` (a server's concurrent requests each take their own).

        Rows of other tags stay. ``forget=True`` also stops recording live requests with these
        tags (a client that went away), so nothing of theirs accumulates afterwards. Counters
        are not reset: they describe the whole recorder, not these tags.
        """
        if self.destination is not None:
            raise RuntimeError("take_tags serves recorders without a RowDestination (the server's)")
        if self._copied is not None:
            self._copied.synchronize()  # type: ignore[attr-defined]
            self._copied = None
        wanted = np.asarray(sorted(set(int(t) for t in tags)), dtype=np.int64)
        if forget:
            for rid, tag in list(self._tags.items()):
                if tag is not None and tag.tag in set(wanted.tolist()):
                    self._tags[rid] = None
                    self._untagged += 1
            self._batch = None
        taken: list[_Step] = []
        kept: list[_Step] = []
        for s in self.steps:
            chunk_hit = np.isin(s.tags, wanted)
            if not chunk_hit.any():
                kept.append(s)
                continue
            if chunk_hit.all():
                taken.append(s)
                continue
            row_hit = torch.from_numpy(np.repeat(chunk_hit, s.lens))
            taken.append(_Step(s.tags[chunk_hit], s.samples[chunk_hit], s.lens[chunk_hit],
                               s.hidden[row_hit], s.meta[:, row_hit]))
            kept.append(_Step(s.tags[~chunk_hit], s.samples[~chunk_hit], s.lens[~chunk_hit],
                              s.hidden[~row_hit], s.meta[:, ~row_hit]))
        self.steps = kept
        self.bytes_held = sum(s.hidden.numel() * s.hidden.element_size() for s in kept)
        rows = self._rows(taken)
        # A recorder error (budget) dropped every request's rows: report it once; the caller
        # recomputes what is missing.
        rows.error, self.error = self.error, None
        rows.stats = {"bytes_held": self.bytes_held}
        return rows

    def _rows(self, steps: list[_Step]) -> CapturedRows:
        """The steps' rows as one :class:`CapturedRows`, the hidden rows left as one part per step."""
        if not steps:
            return empty_rows(tuple(self.settings.layers), self.hidden_size, self.settings.torch_dtype,
                              self.settings.num_columns)
        lens = torch.from_numpy(np.concatenate([s.lens for s in steps]))
        meta = torch.cat([s.meta for s in steps], dim=1)
        return CapturedRows(
            layers=tuple(self.settings.layers),
            hidden_parts=[s.hidden for s in steps],
            tags=torch.repeat_interleave(torch.from_numpy(np.concatenate([s.tags for s in steps])), lens),
            samples=torch.repeat_interleave(torch.from_numpy(np.concatenate([s.samples for s in steps])), lens),
            positions=meta[0].contiguous(),
            token_ids=meta[1].contiguous(),
            chunk_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
        )


def _gathered(picked: list[torch.Tensor], positions: torch.Tensor, input_ids: torch.Tensor,
              runs: list[tuple[int, int]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """New tensors of the runs' rows [R, C, H] (in ``dtype``) and metadata [2, R] (positions,
    token ids): never views of the engine's buffers, which the next forward overwrites."""
    hidden_parts, meta_parts = [], []
    for a, b in runs:
        hidden_parts.append(torch.stack([h[a:b] for h in picked], dim=1))
        meta_parts.append(torch.stack([positions[a:b].to(torch.int64), input_ids[a:b].to(torch.int64)]))
    hidden = (hidden_parts[0] if len(hidden_parts) == 1 else torch.cat(hidden_parts)).to(dtype)
    meta = meta_parts[0] if len(meta_parts) == 1 else torch.cat(meta_parts, dim=1)
    return hidden, meta


def _runs(starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
    """Merge adjacent row ranges, so a batch of tagged requests is one slice."""
    if np.array_equal(starts[1:], ends[:-1]):  # the usual case: every request of the batch is ours
        return [(int(starts[0]), int(ends[-1]))]
    cut = (starts[1:] != ends[:-1]).nonzero()[0] + 1  # a run begins where a chunk does not follow on
    firsts = np.concatenate(([0], cut))
    lasts = np.concatenate((cut - 1, [len(starts) - 1]))
    return list(zip(starts[firsts].tolist(), ends[lasts].tolist()))
