"""What every sink does: where the recorder's tagged rows go, one implementation per transport.

The recorder (recorder.py) decides which rows of a forward are recorded (tags, counters, budget)
and hands each step to the sink of the current generation:

- :class:`~.held.HeldRows`: kept in the worker until the engine side takes them (no destination:
  the server's requests, recomputes, calls outside the generator);
- :class:`~.host_placer.HostPlacerSink`: written into the engine side's destination by the host
  placer thread (placer.py), a batch of steps at a time;
- :class:`~.device_file.DeviceFileSink`: written into the engine side's shared row file by the
  device itself (file_writer.py), the host placer taking over if the device cannot.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..protocol import CapturedRows
from ..step_layout import StepLayout


class Sink(Protocol):
    def holds_rows(self) -> bool:
        """Whether rows of this generation were recorded and not yet taken."""

    def record(self, layout: StepLayout, picked: list[torch.Tensor], positions: torch.Tensor,
               input_ids: torch.Tensor) -> None:
        """Record one forward's tagged rows: ``layout`` says where they are in the forward's
        outputs ``picked`` (one tensor per column), ``positions`` and ``input_ids``."""

    def discard(self) -> None:
        """Drop what is held (the recorder's budget was exceeded)."""

    def take(self) -> CapturedRows:
        """Everything recorded since the last take, once it is all in place; ``error`` is the
        sink's own failure (None: none) and ``stats`` its counters (``forwards_replayed``,
        ``place_seconds``, ``rows_written_on_device``)."""
