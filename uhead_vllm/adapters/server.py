"""vLLM's OpenAI API server internals the serving layer needs (checked against vLLM 0.26 and 0.32).

1. n>1: vLLM fans a request out into children that share one ``extra_args`` dict, so the worker
   could not tell their rows apart. A wrapper around ``ParentRequest._get_child_sampling_params``
   gives child i the sample index i in its capture tag (only for tagged requests).
2. Outputs: :class:`EngineTap` stands in for the engine client of the OpenAI handlers. For a
   request marked by the uncertainty handler it gives each generate call (one per prompt) its own
   capture tag, asks vLLM for the logprobs the head needs, records what vLLM returns and lets the
   server look at each output before the handler does (step scores while a choice runs).
   :func:`abort_sample` ends one sequence of a running call (its siblings run on).
3. The ``serve`` parser: vLLM 0.26 keeps it in ``vllm.entrypoints.openai``, 0.32 in
   ``vllm.entrypoints.launchers`` (:data:`SERVE_MODULES`); the server is ``vllm serve``'s own
   command (one API server, or several with ``--api-server-count``).
4. The gate: :func:`install_engine_gate` makes ``AsyncLLM.add_request`` (every route's way into
   the engine) refuse reserved ``extra_args`` keys the server did not write itself, so capture
   tags and steering reach the worker only from the server's own code (:func:`minted`).
5. Engine death and shutdown: :class:`TrustedEngine` gives the server's own RPCs an end when
   the engine core dies (vLLM never fails a pending utility call then), and
   :func:`end_requests_when_engine_stops` ends every running request when the engine client
   stops (on SIGTERM vLLM cancels its output handler without telling the running requests, whose
   open streams then keep the HTTP server from ever shutting down).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from copy import copy
from types import ModuleType
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable

from ..capture.protocol import RequestTag
from ..errors import ReservedKeysError
from .versions import SUPPORTED_VLLM, parse_version

#: (major, minor) -> module of ``make_arg_parser`` / ``validate_parsed_serve_args``.
SERVE_MODULES: dict[tuple[int, int], str] = {
    (0, 26): "vllm.entrypoints.openai.cli_args",
    (0, 32): "vllm.entrypoints.launchers.cli_args",
}

#: ``vllm_xargs`` key through which the handler marks a request for the tap (never reaches vLLM):
#: the request's record key, or "" for a checked request without uncertainty (steering only).
MARK = "uhead_vllm_serve"
#: ``extra_args`` key of :class:`Minted`; removed by the gate before the engine sees the request.
MINTED_KEY = "uhead_vllm_minted"
#: How often a waiting RPC looks whether the engine core is still alive (seconds).
DEATH_POLL_S = 0.2


class Minted:
    """Marks ``extra_args`` the server wrote itself. A class object: no JSON value can be it, and
    copies (shallow or deep) keep it, so a client cannot forge it on any route."""


def minted(params: Any) -> Any:
    """A copy of ``params`` whose reserved ``extra_args`` keys the gate lets through."""
    params = copy(params)
    params.extra_args = {**(params.extra_args or {}), MINTED_KEY: Minted}
    return params


def install_engine_gate(engine: Any, reserved: Callable[[dict], list[str]]) -> None:
    """Wrap ``engine.add_request`` (this instance only): a request whose ``extra_args`` holds keys
    ``reserved`` names is refused (``ReservedKeysError``, a ValueError: HTTP 400) unless the server
    minted them; the mark itself is removed before the request goes on. Idempotent."""
    if getattr(engine, "_uhead_gate", False):
        return
    add_request = engine.add_request

    async def gated_add_request(request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        return await add_request(request_id, prompt, _checked(params, reserved), *args, **kwargs)

    engine.add_request = gated_add_request
    engine._uhead_gate = True


def _checked(params: Any, reserved: Callable[[dict], list[str]]) -> Any:
    extra = getattr(params, "extra_args", None)
    if not extra:
        return params
    if extra.get(MINTED_KEY) is Minted:
        params = copy(params)  # one params object may serve several prompts: never edit it
        params.extra_args = {k: v for k, v in extra.items() if k != MINTED_KEY}
        return params
    bad = reserved(extra)
    if bad:
        raise ReservedKeysError(f"extra_args keys {bad} are reserved for the uncertainty server (capture tags "
                                "and steering are written by the server itself)")
    return params


class TrustedEngine:
    """The engine client as the server's own code uses it: its generate calls are minted (the
    recompute's capture tag and steering pass the gate), and its RPCs end with vLLM's
    ``EngineDeadError`` as soon as the engine core is dead instead of waiting forever."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._engine.generate(prompt, minted(sampling_params), request_id, *args, **kwargs)

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> Any:
        return await until_engine_dies(self._engine, self._engine.collective_rpc(method, timeout, args, kwargs))


_WATCHERS: set[asyncio.Task] = set()


def end_requests_when_engine_stops(engine: Any) -> None:
    """Watch ``engine`` (on the running loop); once it is dead or shut down, fail every request
    still waiting for outputs with ``EngineDeadError``, as vLLM does when its output handler
    fails: their handlers end them (a stream: vLLM's error event, then ``[DONE]``)."""

    async def watch() -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        while not engine.errored:
            await asyncio.sleep(DEATH_POLL_S)
        engine.output_processor.propagate_error(EngineDeadError())

    task = asyncio.ensure_future(watch())
    _WATCHERS.add(task)
    task.add_done_callback(_WATCHERS.discard)


async def until_engine_dies(engine: Any, call: Any) -> Any:
    """Await ``call`` (an RPC to the engine core), or raise vLLM's ``EngineDeadError`` once the
    engine is dead: vLLM never fails a pending utility call when its engine core dies."""
    from vllm.v1.engine.exceptions import EngineDeadError

    task = asyncio.ensure_future(call)
    try:
        while not task.done():
            if engine.errored:
                raise EngineDeadError()
            await asyncio.wait({task}, timeout=DEATH_POLL_S)
        return task.result()
    finally:
        if not task.done():
            task.cancel()


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
        params.extra_args = {**params.extra_args, **RequestTag(tag.tag, index, tag.start).to_extra_args()}
        return params

    ParentRequest._get_child_sampling_params = child_params
    ParentRequest._uhead_child_tags = True


#: Called with (record, prompt index, output) for each output of a marked request, before the handler sees it.
Watch = Callable[[Any, int, Any], Awaitable[None]]


class EngineTap:
    """Engine client proxy: everything passes through; marked generate calls are tagged and seen.

    A record that ``watches_running`` (it acts while its choices run) gets every output even when
    the handler asked for the final one only (non-streamed requests): vLLM is asked for cumulative
    outputs and the handler gets one final output, the n sequences gathered as vLLM would."""

    def __init__(self, engine: Any, registry: dict[str, Any], watch: Watch | None = None):
        self._engine = engine
        self._registry = registry
        self._watch = watch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        from vllm.sampling_params import RequestOutputKind

        extra = getattr(sampling_params, "extra_args", None) or {}
        if MARK not in extra:
            return self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs)
        record = self._registry.get(extra[MARK])
        params = minted(sampling_params)  # a copy: shared by all prompts of a completions request
        params.extra_args.pop(MARK)
        if record is None:  # checked by the handler, nothing to capture (steering only)
            return self._engine.generate(prompt, params, request_id, *args, **kwargs)
        prompt_len = _prompt_len(prompt)
        index, tag = record.new_prompt(params.n, params.output_kind == RequestOutputKind.DELTA,
                                       prompt_len, params.max_tokens, request_id)
        # Scoring reads the generated tokens' rows only: capture just those unless rows were asked for.
        start = (prompt_len or 0) if record.spec.rows is None else 0
        params.extra_args.update(RequestTag(tag, 0, start).to_extra_args())
        params.logprobs = max(params.logprobs or 0, record.logprobs_needed) if record.logprobs_needed else params.logprobs
        gather = record.watches_running and params.output_kind == RequestOutputKind.FINAL_ONLY
        if gather:
            params.output_kind = RequestOutputKind.CUMULATIVE
        return self._seen(self._engine.generate(prompt, params, request_id, *args, **kwargs), record, index,
                          self._watch, gather)

    @staticmethod
    async def _seen(outputs: AsyncGenerator[Any, None], record: Any, index: int, watch: Watch | None,
                    gather: bool) -> AsyncIterator[Any]:
        latest: dict[int, Any] = {}  # gather: each sequence's newest cumulative output
        try:
            async for out in outputs:
                record.observe(index, out)
                if watch is not None:
                    await watch(record, index, out)
                if not gather:
                    yield out
                    continue
                latest.update((o.index, o) for o in out.outputs)
                if out.finished:
                    final = copy(out)
                    final.outputs = [latest[i] for i in sorted(latest)]
                    yield final
        finally:
            await outputs.aclose()  # closing vLLM's generator aborts the request now, not at GC


async def abort_sample(engine: Any, request_id: str, sample: int) -> bool:
    """Abort sample ``sample`` of the running generate call ``request_id`` (the id the handler gave
    it) in vLLM now; its other samples run on. vLLM's output processor ends it with a last output
    (``finish_reason`` "abort") through the call's own stream. False where it had ended already.

    vLLM keeps each sequence under an internal id (0.32: the call's id plus a random suffix, n>1
    children ``f"{i}_{parent}"``), listed per call id in ``external_req_ids``; older versions use
    the call's id itself."""
    processor = engine.output_processor
    mapping = getattr(processor, "external_req_ids", None)
    candidates = list(mapping.get(request_id, ())) if mapping is not None else [request_id, f"{sample}_{request_id}"]
    ids = [i for i in candidates if getattr(processor.request_states.get(i), "request_index", None) == sample]
    if not ids:
        return False
    if "internal" in inspect.signature(engine.abort).parameters:
        await engine.abort(ids, internal=True)
    else:
        await engine.abort(ids)
    return True


def _serve_parser_module() -> ModuleType:
    """This vLLM's serve-parser module (the newest checked layout for a version allowed outside
    the checked set)."""
    import vllm

    version = parse_version(str(vllm.__version__))
    name = SERVE_MODULES.get(version) or SERVE_MODULES[max(v for v in SERVE_MODULES if v in SUPPORTED_VLLM)]
    return importlib.import_module(name)


def _prompt_len(prompt: Any) -> int | None:
    """Token count of a rendered prompt (vLLM's engine input), None when it has no token ids."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    return len(ids) if isinstance(ids, list) else None


def parse_serve_args(argv: list[str], prog: str) -> Any:
    """Parse ``argv`` with vLLM's own ``vllm serve`` parser and validate it."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_args = _serve_parser_module()
    vargs = cli_args.make_arg_parser(FlexibleArgumentParser(prog=prog)).parse_args(argv)
    cli_args.validate_parsed_serve_args(vargs)
    return vargs


def run_api_server(vargs: Any) -> None:
    """Run vLLM's own OpenAI-compatible server as ``vllm serve`` runs it, until it shuts down:
    one API server in this process, or with ``--api-server-count N`` the engine core and N API
    server processes (each builds its app with the middleware; a request's rows are taken by tag
    by the process that serves it). ``vllm.entrypoints.cli.serve`` in 0.26 and 0.32."""
    from vllm.entrypoints.cli.serve import ServeSubcommand

    ServeSubcommand.cmd(vargs)
