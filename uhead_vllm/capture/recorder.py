"""Per-step recording of tagged requests' rows, inside the worker.

The runner adapter hands the recorder each step's schedule (which requests are new, how many
tokens each gets) and, after the forward, the step's outputs. The recorder keeps the tag book
(tags.py), the counters and the memory budget, finds the forward's tagged rows (step_layout.py:
a slice per contiguous run of tagged requests, usually one) and hands them to the sink of the
current generation (sinks/): held until taken, or written into the engine side's destination
during the generation, by the host placer or by the device. Nothing on the hot path waits for the
device; ``take`` waits once and returns one :class:`CapturedRows`.

Counters say what happened, separately: forwards seen, forwards that had tagged rows scheduled,
forwards recorded, rows scheduled for tagged requests and rows recorded. A difference between the
last two means capture missed rows (never the prefix cache: cached tokens are not scheduled).
Rows below a request's capture window (its tag's ``start``) are neither expected nor recorded,
never gathered nor copied off the device: they are counted as skipped. ``bytes_to_host`` counts
the bytes of the rows recorded, all of which leave the device.

With a head's token-inputs weight ``[D, L * H]`` (settings' ``token_inputs``) the forward's columns
are reduced on the device to the head's ``D`` inputs per token before any sink sees them: every
sink then handles one float32 column of width ``D`` (the recorder's ``hidden_size``), unchanged.
"""

from __future__ import annotations

import time

import torch

from ..adapters import ScheduledStep, StepOutputs
from .cuda_streams import CopyStream
from .destination import RowDestination
from .file_writer import FileWriter
from .placer import Placer
from .protocol import CapturedRows, CaptureSettings
from .sinks import DeviceFileSink, HeldRows, HostPlacerSink, Sink
from .staging import HostStaging
from .step_batch import StepBatcher
from .step_layout import BatchFacts
from .tags import TagBook


class EngineTime:
    """Wall and CPU seconds the engine's thread spent in some work, and how often (``with``): CPU
    time well below wall time means waiting, for the GIL or the device."""

    __slots__ = ("calls", "seconds", "cpu_seconds", "_start")

    def __init__(self) -> None:
        self.calls, self.seconds, self.cpu_seconds = 0, 0.0, 0.0

    def __enter__(self) -> None:
        self._start = (time.perf_counter(), time.thread_time())

    def __exit__(self, *exc: object) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - self._start[0]
        self.cpu_seconds += time.thread_time() - self._start[1]


class RowRecorder:
    """Records the tagged rows of every forward until the engine side takes them."""

    def __init__(self, settings: CaptureSettings, aux_layers: tuple[int, ...], hidden_size: int,
                 weight: torch.Tensor | None = None) -> None:
        self.settings = settings
        self.aux_layers = aux_layers  # the layers the model emits, sorted (vLLM sorts them)
        self.weight = weight  # [D, L * H] float32 on the runner's device: rows are reduced to D inputs
        self.hidden_size = hidden_size if weight is None else int(weight.shape[0])  # width of one column
        self._reduced: torch.Tensor | None = None  # the reduced rows' buffer (a stable address for step graphs)
        self._select = [aux_layers.index(k) for k in settings.layers]  # requested order in the aux outputs
        self.tags = TagBook()
        self.error: str | None = None  # reported with the next take (the first one wins)
        self.forwards_seen = 0
        self.forwards_expected = 0  # forwards with rows of tagged requests scheduled
        self.forwards_recorded = 0
        self.rows_expected = 0  # rows of tagged requests vLLM scheduled (so computed)
        self.rows_recorded = 0
        self.rows_skipped = 0  # rows of tagged requests scheduled below their capture window (not recorded)
        self.bytes_to_host = 0  # bytes of the rows recorded (every sink sends them to the host)
        self.below: dict[str, int] = {}  # this step's requests with leading rows below their window -> how many
        self.chunks_recorded = 0  # (request, forward) pairs recorded: with accepted drafts, fewer than tokens
        self.scheduled_rows = 0  # tagged rows scheduled in the step that is running now
        self.recording = EngineTime()  # the engine thread's time in the recorder (this generation)
        self.tag_takes = EngineTime()  # ... in a server's tag takes (since the start)
        self.destination: RowDestination | None = None  # rows go here during the generation
        self._batch: BatchFacts | None = None  # the last forward's batch facts (None: rebuild)
        copies = CopyStream()
        placer, staging = Placer(), HostStaging(copies)
        self.held = HeldRows(settings, self.hidden_size, copies)
        # Each way of placing keeps its sink (buffers and step graphs), so calls alternating ways stay warm.
        self.host_placer = HostPlacerSink(settings, self.hidden_size, placer, staging)
        self.device_writer = DeviceFileSink(settings, self.hidden_size, placer, staging)
        self._sink: Sink = self.held
        self._last_placing: HostPlacerSink | None = None

    @property
    def bytes_held(self) -> int:
        """Bytes of rows held until taken (the budget counts them)."""
        return self.held.bytes_held

    def engine_time(self) -> dict:
        """What capture cost the engine's thread: forwards recorded and the recorder's seconds
        (this generation), tag takes and their seconds (since the start); wall and CPU."""
        return {"forwards_recorded": self.forwards_recorded, "record_seconds": round(self.recording.seconds, 6),
                "record_cpu_seconds": round(self.recording.cpu_seconds, 6), "tag_takes": self.tag_takes.calls,
                "tag_take_seconds": round(self.tag_takes.seconds, 6),
                "tag_take_cpu_seconds": round(self.tag_takes.cpu_seconds, 6)}

    @property
    def rows_placed(self) -> int:
        """Rows of this generation sent to its destination so far."""
        return self._last_placing.rows_placed if self._sink is self._last_placing else 0

    @property
    def _batcher(self) -> StepBatcher | None:
        """The step batcher of the last generation that placed its rows."""
        return None if self._last_placing is None else self._last_placing.batcher

    # ------------------------------------------------------------------ schedule
    def on_schedule(self, step: ScheduledStep) -> None:
        with self.recording:
            self._schedule(step)

    def _schedule(self, step: ScheduledStep) -> None:
        if step.new_requests or step.finished_req_ids:
            self._batch = None
        self.tags.finished(step.finished_req_ids)
        for rid, extra_args in step.new_requests:
            problem = self.tags.register(rid, extra_args)
            if problem is not None:
                self.fail(problem)
        rows = self.tags.scheduled_rows(step.num_scheduled_tokens)
        if step.resumed:
            self.tags.resumed(step.resumed)
        self.below = {}
        if self.tags.windows:  # some live request's window is not reached yet (else: nothing to do)
            self.below = self.tags.below_windows(step.num_scheduled_tokens, step.num_computed())
            skipped = sum(self.below.values())
            rows -= skipped
            self.rows_skipped += skipped
        self.scheduled_rows = rows
        if rows:
            self.forwards_expected += 1
            self.rows_expected += rows

    def fail(self, message: str) -> None:
        """Report a problem to the engine side with the next take (the first one wins)."""
        if self.error is None:
            self.error = message

    # ------------------------------------------------------------------ forward
    def on_forward(self, step: StepOutputs, streams: list[torch.Tensor] | None = None,
                   points: list[torch.Tensor] | None = None) -> None:
        """Record the tagged rows of one forward. ``streams`` (layer-hook route) replace
        ``step.aux``; both are in sorted HF-index order. ``points`` are the sublayer sites'
        values in ``settings.points`` order (columns after the layers)."""
        with self.recording:
            self._record(step, streams, points)

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
        layout = self._batch_facts(step.req_ids).layout(step.query_start_loc, self.below)
        if layout is None:
            return
        n_rows = layout.n_rows
        new_bytes = n_rows * self.settings.num_columns * self.hidden_size * self.settings.torch_dtype.itemsize
        if self.bytes_held + new_bytes > self.settings.max_bytes:
            self.error = (
                f"capture memory budget exceeded: holding {self.bytes_held} bytes, this forward "
                f"adds {new_bytes}, budget max_bytes={self.settings.max_bytes}. Raise max_bytes, "
                "capture fewer layers or use bfloat16, or generate in smaller batches"
            )
            self._sink.discard()
            return
        picked = [source[j] for j in self._select] + list(points or ())
        if self.weight is not None:
            picked = [self._reduce(picked, layout.runs)]
        positions = step.positions[0] if step.positions.dim() > 1 else step.positions  # M-RoPE: text row
        self._sink.record(layout, picked, positions, step.input_ids)
        self.forwards_recorded += 1
        self.rows_recorded += n_rows
        self.bytes_to_host += new_bytes
        self.chunks_recorded += len(layout.lens)

    def _reduce(self, picked: list[torch.Tensor], runs: list[tuple[int, int]]) -> torch.Tensor:
        """``[T, D]`` float32: the forward's rows (the layers in settings order) times the weight, on
        the device, into one buffer reused forward after forward (sinks copy rows out, as they do
        the engine's own outputs, before the next forward overwrites them). Only the rows of
        ``runs`` are computed, the ones every sink reads: a prefill's prompt rows below the
        requests' capture windows and untagged requests' rows cost nothing (a float32 copy of a
        whole 8,192-token prefill of two 4,096-wide layers was 256 MiB)."""
        weight, n = self.weight, picked[0].shape[0]
        assert weight is not None
        buf = self._reduced
        if buf is None or buf.shape[0] < n or buf.device != picked[0].device:
            buf = self._reduced = torch.empty(max(n, 256), weight.shape[0], dtype=torch.float32, device=picked[0].device)
        for a, b in runs:
            torch.mm(torch.cat([h[a:b] for h in picked], -1).to(torch.float32), weight.T, out=buf[a:b])
        return buf[:n]

    def _batch_facts(self, req_ids: list[str]) -> BatchFacts:
        """This forward's per-request facts, reused while the batch stays the same."""
        batch = self._batch
        if batch is None or batch.req_ids != req_ids:
            batch = self._batch = BatchFacts.of(req_ids, self.tags.get, self.destination)
        return batch

    # ------------------------------------------------------------------ take
    def place_into(self, destination: RowDestination | None, writer: FileWriter | None = None) -> None:
        """Write the rows of the coming generation into ``destination`` (until the next ``take``);
        with ``writer`` (the destination's row file as the device sees it) the device writes them.
        The destination's slots announce the generation's tags (tags.py)."""
        if any(s.holds_rows() for s in (self.held, self.host_placer, self.device_writer)):
            raise RuntimeError("rows of an earlier generation are still held: take them first")
        if writer is not None and destination is None:
            raise ValueError("a file writer needs the destination it writes")
        self.destination = destination
        self._batch = None  # its slots are the destination's
        self.tags.announced = None if destination is None else set(destination.slots)
        if destination is None:
            self._sink = self.held
        elif writer is None:
            self.host_placer.begin(destination)
            self._sink = self._last_placing = self.host_placer
        else:
            self.device_writer.begin(destination, writer)
            self._sink = self._last_placing = self.device_writer

    def take(self) -> CapturedRows:
        """Hand over everything recorded so far and start afresh."""
        bytes_held = self.bytes_held
        rows = self._sink.take()
        sink_stats = rows.stats
        rows.stats = {"forwards_seen": self.forwards_seen, "forwards_expected": self.forwards_expected,
                      "forwards_replayed": sink_stats["forwards_replayed"],
                      "forwards_recorded": self.forwards_recorded, "rows_expected": self.rows_expected,
                      "rows_recorded": self.rows_recorded, "chunks_recorded": self.chunks_recorded,
                      "rows_skipped": self.rows_skipped, "bytes_to_host": self.bytes_to_host,
                      "bytes": bytes_held,
                      "record_seconds": round(self.recording.seconds, 6),
                      "place_seconds": round(sink_stats["place_seconds"], 6),
                      "rows_written_on_device": sink_stats["rows_written_on_device"]}
        rows.error = self.error or rows.error
        self.error = None
        self._sink, self.destination, self.tags.announced = self.held, None, None
        self._batch = None
        self.forwards_seen = self.forwards_expected = self.forwards_recorded = 0
        self.recording = EngineTime()
        self.rows_expected = self.rows_recorded = self.chunks_recorded = 0
        self.rows_skipped = self.bytes_to_host = 0
        return rows

    def take_tags(self, tags: list[int], forget: bool = False) -> CapturedRows:
        """Hand over only the rows of ``tags`` (a server's concurrent requests each take their own).

        Rows of other tags stay. ``forget=True`` also stops recording live requests with these
        tags (a client that went away), so nothing of theirs accumulates afterwards. Counters
        are not reset: they describe the whole recorder, not these tags.
        """
        if self.destination is not None:
            raise RuntimeError("take_tags serves recorders without a RowDestination (the server's)")
        if forget:
            self.tags.forget({int(t) for t in tags})
            self._batch = None
        with self.tag_takes:
            rows = self.held.take_tags(tags, forget)
        # A recorder error (budget) dropped every request's rows: report it once; the caller
        # recomputes what is missing.
        rows.error, self.error = self.error, None
        rows.stats = {"bytes_held": self.bytes_held}
        return rows
