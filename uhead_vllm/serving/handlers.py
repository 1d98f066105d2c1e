"""Wrappers around vLLM's own OpenAI handlers (chat and completions), nothing re-implemented.

A request without ``uncertainty`` goes straight to vLLM. With it, the wrapper checks the field,
marks the request for the engine tap, lets vLLM's handler run, then adds per choice an
``uncertainty`` object to vLLM's response: ``{answer_p_wrong, steps: [{text, token_start,
token_end, p_wrong}], head, rows?}``. Streaming: a chunk that completes a step of a choice carries
``uncertainty: {steps: [that step]}`` for it; the chunk with the choice's ``finish_reason``
carries the full object.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, AsyncIterator, Callable

from .record import RequestRecord
from .service import UncertaintyService
from .spec import BadUncertaintyRequest, check_row_budget, check_user_xargs, parse_steer, parse_uncertainty, row_bytes
from ..adapters.server import MARK
from ..generation.steering import CAPTURE_CACHE_SALT

logger = logging.getLogger("uhead_vllm.serving")


def wrap_handler(handler: Any, method: str, service: UncertaintyService) -> None:
    """Replace ``handler.<method>`` (e.g. ``create_chat_completion``) by the uncertainty wrapper."""
    original: Callable[..., Any] = getattr(handler, method)
    chat = method == "create_chat_completion"

    async def create(request: Any, raw_request: Any = None) -> Any:
        try:
            check_user_xargs(request.vllm_xargs)
            steer = parse_steer((request.model_extra or {}).get("steer"), request.vllm_xargs, service.settings.steering,
                                service.num_layers, service.hidden_size, handler.model_config.dtype)
            spec = parse_uncertainty((request.model_extra or {}).get("uncertainty"), service.limits)
            if spec is not None:
                max_tokens = (request.max_completion_tokens if chat and request.max_completion_tokens is not None
                              else request.max_tokens)
                prompts = 1 if chat else _num_prompts(request.prompt)
                check_row_budget(spec, prompts * (request.n or 1), max_tokens, service.hidden_size)
                if getattr(request, "use_beam_search", False):
                    raise BadUncertaintyRequest("uncertainty is not served with beam search")
        except BadUncertaintyRequest as exc:
            return handler.create_error_response(str(exc))
        salt = ""
        if steer is not None:
            # Steered states are other states for the same tokens: their own KV blocks and stored rows.
            salt = steer.digest() if not request.cache_salt else f"{request.cache_salt}:{steer.digest()}"
            request.cache_salt = salt
            # MARK "": checked here, so the tap mints it for the engine's gate (nothing to capture)
            request.vllm_xargs = {**(request.vllm_xargs or {}), **steer.to_extra_args(), MARK: ""}
        if spec is None:
            return await original(request, raw_request)
        if steer is None:
            # Captured requests reuse only blocks that captured requests computed (whose rows the
            # row store may hold), never a plain request's: see generation/steering.py.
            request.cache_salt = (CAPTURE_CACHE_SALT if not request.cache_salt
                                  else f"{request.cache_salt}:{CAPTURE_CACHE_SALT}")
        # Rows are stored and recomputed under the request's whole cache_salt (a client's own included).
        steer_args = steer.to_extra_args() if steer is not None else {}
        record = service.open(spec, salt=request.cache_salt, steer_args=steer_args)
        record.row_bytes = row_bytes(spec, service.hidden_size)  # the tap checks the budget per prompt
        request.vllm_xargs = {**(request.vllm_xargs or {}), MARK: record.key}
        try:
            result = await original(request, raw_request)
        except BadUncertaintyRequest as exc:  # the rows budget, checked with the prompt before generating
            service.release_soon(record)
            return handler.create_error_response(str(exc))
        except BaseException:
            service.release_soon(record)
            raise
        if not hasattr(result, "choices"):
            if hasattr(result, "__aiter__"):
                return _stream(result, record, service)
            service.release_soon(record)  # an ErrorResponse from vLLM
            return result
        try:
            await service.fetch(record)
            objects = [finite_scores(await service.choice_uncertainty(record, c.index)) for c in result.choices]
            service.check_rows_size(record, objects)
            for choice, obj in zip(result.choices, objects):
                setattr(choice, "uncertainty", obj)
        except BadUncertaintyRequest as exc:
            return handler.create_error_response(str(exc))
        finally:
            service.release_soon(record)
        return result

    setattr(handler, method, create)


def finite_scores(obj: Any) -> Any:
    """The uncertainty object with every non-finite number (a NaN score of overflowing states)
    as null: JSON has no NaN, and a bare ``NaN`` would break a client's parser."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_scores(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite_scores(v) for v in obj]
    return obj


def _num_prompts(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


async def _stream(chunks: AsyncIterator[str], record: RequestRecord, service: UncertaintyService) -> AsyncIterator[str]:
    """vLLM's SSE stream with uncertainty added to the chunks that complete steps or choices."""
    done = False
    try:
        async for text in chunks:
            yield await _annotate(text, record, service)
        done = True
    finally:
        if hasattr(chunks, "aclose"):
            try:
                await chunks.aclose()  # client gone: vLLM aborts the request before we forget it
            except RuntimeError:
                pass
        if done:
            try:
                await service.release(record)
            except Exception:  # the engine died: the stream still ends as vLLM ended it (error, [DONE])
                logger.warning("uncertainty request %s not released: %s", record.key, "engine dead", exc_info=True)
        else:
            service.release_soon(record)


async def _annotate(text: str, record: RequestRecord, service: UncertaintyService) -> str:
    events = text.split("\n\n")
    changed = False
    for i, event in enumerate(events):
        if not event.startswith("data: {"):
            continue
        chunk = json.loads(event[len("data: "):])
        touched = False
        for choice in chunk.get("choices", []):
            idx = choice.get("index", 0)
            try:
                if choice.get("finish_reason") is not None:
                    await service.fetch(record)
                    obj = finite_scores(await service.choice_uncertainty(record, idx))
                    _count_rows_sent(record, obj)
                    choice["uncertainty"] = obj
                    touched = True
                elif record.spec.steps and _step_may_end(choice, record, service, idx):
                    sent = _seq(record, idx).steps_sent
                    steps = await service.new_stream_steps(record, idx)
                    if _seq(record, idx).steps_sent > sent:
                        _seq(record, idx).boundary_pending = False
                    if steps:
                        choice["uncertainty"] = {"steps": finite_scores(steps)}
                        touched = True
            except Exception as exc:  # never break the answer stream over a score
                logger.exception("uncertainty for choice %s failed", idx)
                choice["uncertainty"] = {"error": f"{type(exc).__name__}: {exc}"}
                touched = True
        if touched:
            events[i] = "data: " + json.dumps(chunk, ensure_ascii=False)
            changed = True
    return "\n\n".join(events) if changed else text


def _count_rows_sent(record: RequestRecord, obj: dict) -> None:
    """The rows budget is per response, streamed or not: the choices' rows add up. (The tap
    refuses before generating what could exceed it; this holds where a prompt length was unknown.)"""
    rows = obj.get("rows")
    if not record.spec.rows or not isinstance(rows, dict) or "raw_bytes" not in rows:
        return
    record.rows_sent += rows["raw_bytes"]
    if record.rows_sent > record.spec.max_bytes:
        obj["rows"] = {"error": f"rows budget exceeded: the rows of this response take {record.rows_sent} bytes "
                                f"(prompt rows included) > max_bytes {record.spec.max_bytes}"}


def _step_may_end(choice: dict, record: RequestRecord, service: UncertaintyService, idx: int) -> bool:
    """Re-split a running choice only after a possible step boundary (splitting costs decodes);
    the flag stays up until the step after the boundary has begun and was scored."""
    prompt_index, sample = record.locate(idx)
    seq = record.prompts[prompt_index].seqs.get(sample) if prompt_index < len(record.prompts) else None
    if seq is None:
        return False
    delta = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
    assert service.scorer is not None  # called for a request that asks for steps: the server has a head
    if delta and service.scorer.step_boundary_possible(delta):
        seq.boundary_pending = True
    return seq.boundary_pending


def _seq(record: RequestRecord, idx: int) -> Any:
    prompt_index, sample = record.locate(idx)
    return record.prompts[prompt_index].seqs[sample]
