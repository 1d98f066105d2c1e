"""vLLM's OpenAI API server internals the serving layer needs (checked against vLLM 0.26 and 0.32).

1. n>1: vLLM fans a request out into children that share one ``extra_args`` dict, so the worker
   could not tell their rows apart. A wrapper around ``ParentRequest._get_child_sampling_params``
   gives child i the sample index i in its capture tag (only for tagged requests).
2. Outputs: :class:`EngineTap` stands in for the engine client of the OpenAI handlers. For a
   request marked by the uncertainty handler it gives each generate call (one per prompt) its own
   capture tag, asks vLLM for the logprobs the head needs, and records what vLLM returns.
3. The ``serve`` parser and server: vLLM 0.26 keeps them in ``vllm.entrypoints.openai``, 0.32 in
   ``vllm.entrypoints.launchers`` (:data:`SERVE_MODULES`).
"""

from __future__ import annotations

import importlib
from copy import copy
from types import ModuleType
from typing import Any, AsyncGenerator, AsyncIterator, Callable

from ..capture.protocol import RequestTag
from .versions import SUPPORTED_VLLM, parse_version

#: (major, minor) -> (module of ``make_arg_parser`` / ``validate_parsed_serve_args``, module of ``run_server``).
SERVE_MODULES: dict[tuple[int, int], tuple[str, str]] = {
    (0, 26): ("vllm.entrypoints.openai.cli_args", "vllm.entrypoints.openai.api_server"),
    (0, 32): ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.launchers.api_server.entry"),
}

#: ``vllm_xargs`` key through which the handler marks a request for the tap (never reaches vLLM).
MARK = "uhead_vllm_serve"


def install_child_tags() -> None:
    """Give every child of a tagged n>1 request its own sample index (idempotent)."""
    from vllm.v1.engine.parallel_sampling import ParentRequest

    if getattr(ParentRequest, "_uhead_child_tags", False):
        return
    original: Callable[[Any, int], Any] = ParentRequest._get_child_sampling_params

    def child_params(self: Any, index: int) -> Any:
        params = original(self, index)
        tag = RequestTag.from_extra_args(params.extra_args)
        if tag is None:
            return params
        params = copy(params)  # vLLM reuses one child object when there is no seed
        params.extra_args = {**params.extra_args, **RequestTag(tag.tag, index).to_extra_args()}
        return params

    ParentRequest._get_child_sampling_params = child_params
    ParentRequest._uhead_child_tags = True


class EngineTap:
    """Engine client proxy: everything passes through; marked generate calls are tagged and seen."""

    def __init__(self, engine: Any, registry: dict[str, Any]):
        self._engine = engine
        self._registry = registry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        from vllm.sampling_params import RequestOutputKind

        extra = getattr(sampling_params, "extra_args", None) or {}
        record = self._registry.get(extra[MARK]) if MARK in extra else None
        if record is None:
            return self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs)
        params = copy(sampling_params)  # shared by all prompts of a completions request
        index, tag = record.new_prompt(params.n, params.output_kind == RequestOutputKind.DELTA)
        params.extra_args = {**{k: v for k, v in extra.items() if k != MARK}, **RequestTag(tag, 0).to_extra_args()}
        params.logprobs = max(params.logprobs or 0, record.logprobs_needed) if record.logprobs_needed else params.logprobs
        return self._seen(self._engine.generate(prompt, params, request_id, *args, **kwargs), record, index)

    @staticmethod
    async def _seen(outputs: AsyncGenerator[Any, None], record: Any, index: int) -> AsyncIterator[Any]:
        try:
            async for out in outputs:
                record.observe(index, out)
                yield out
        finally:
            await outputs.aclose()  # closing vLLM's generator aborts the request now, not at GC


def _serve_modules() -> tuple[ModuleType, ModuleType]:
    """This vLLM's serve-parser and server modules (the newest checked layout for a version allowed
    outside the checked set)."""
    import vllm

    version = parse_version(str(vllm.__version__))
    names = SERVE_MODULES.get(version) or SERVE_MODULES[max(v for v in SERVE_MODULES if v in SUPPORTED_VLLM)]
    return importlib.import_module(names[0]), importlib.import_module(names[1])


def parse_serve_args(argv: list[str], prog: str) -> Any:
    """Parse ``argv`` with vLLM's own ``vllm serve`` parser and validate it."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_args, _ = _serve_modules()
    vargs = cli_args.make_arg_parser(FlexibleArgumentParser(prog=prog)).parse_args(argv)
    cli_args.validate_parsed_serve_args(vargs)
    return vargs


def run_api_server(vargs: Any) -> None:
    """Run vLLM's own OpenAI-compatible API server until it shuts down."""
    import uvloop

    _, server = _serve_modules()
    uvloop.run(server.run_server(vargs))
