"""Worker side: runs inside the vLLM worker process. Imports nothing from the engine side."""

from .protocol import CAPTURE_KEY, EXTENSION_QUALNAME, CapturedRows, CaptureSettings, RequestTag

__all__ = ["CAPTURE_KEY", "EXTENSION_QUALNAME", "CapturedRows", "CaptureSettings", "RequestTag"]
