"""The recorder's one side stream: every device-to-host copy and the device's row-file writes.

Work queued here never holds up the next step's forward on the main stream: the side stream first
waits (on the device) for what the main stream queued so far (the gathers that made the rows), and
each piece of work ends with a blocking CUDA event, after which its source tensors may be reused
(a thread waiting on a blocking event sleeps instead of spinning in the driver beside the
engine thread's launches). Streams are switched by hand: ``torch.cuda.stream(...)`` looks the
device and both streams up again (~40 us a step at 256 requests on an H100 host, bench_recorder),
so this does as vLLM's own copies do. On CPU nothing here runs: the rows are on the host at once.
"""

from __future__ import annotations

from typing import Callable

import torch


class CopyStream:
    """The side stream (made at first use) and the event of the last work queued on it."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self.last: torch.cuda.Event | None = None  # after the last copy or write queued

    def copy_to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        """Queue ``host.copy_(device)`` for each ``(host, device)`` pair, asynchronously (the host
        tensors must be pinned); returns the event after which the copies are done."""
        stream, main = self._streams(pairs[0][1].device)
        torch.cuda.set_stream(stream)
        try:
            for host, t in pairs:
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the allocator must not hand ``t`` out before the copy ran
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        finally:
            torch.cuda.set_stream(main)
        self.last = event
        return event

    def run(self, device: torch.device, work: Callable[[], None], used: tuple[torch.Tensor, ...]) -> torch.cuda.Event:
        """Queue ``work`` (its launches) on the side stream; ``used``: device tensors it reads that
        the allocator must not hand out before it ran. Returns the event after it."""
        stream, main = self._streams(device)
        torch.cuda.set_stream(stream)
        try:
            work()
            for t in used:
                t.record_stream(stream)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        finally:
            torch.cuda.set_stream(main)
        self.last = event
        return event

    def synchronize(self) -> None:
        """Wait until everything queued so far is done."""
        if self.last is not None:
            self.last.synchronize()
            self.last = None

    def _streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The side stream, made to wait for what the main stream queued so far, and the main stream."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        main = torch.cuda.current_stream(self._stream.device_index)
        self._stream.wait_stream(main)  # the gathers that made the rows
        return self._stream, main
