"""The recorder's sinks: one per transport of the rows (see base.py)."""

from .base import Sink
from .device_file import DeviceFileSink
from .held import HeldRows
from .host_placer import HostPlacerSink

__all__ = ["DeviceFileSink", "HeldRows", "HostPlacerSink", "Sink"]
