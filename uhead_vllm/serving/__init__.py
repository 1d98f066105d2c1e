"""Serving answers with per-step uncertainty over vLLM's own OpenAI-compatible server.

``uhead-vllm serve`` (see :mod:`.launch`) or ``vllm serve ... --middleware
uhead_vllm.serving.UncertaintyMiddleware`` with the capture extension; docs/serving.md.
"""

from .middleware import UncertaintyMiddleware

__all__ = ["UncertaintyMiddleware"]
