"""Wrappers around vLLM's own OpenAI handlers (chat and completions), nothing re-implemented.

A request without ``uncertainty`` goes straight to vLLM. With it, the wrapper checks the field,
marks the request for the engine tap, lets vLLM's handler run, then adds per choice an
``uncertainty`` object to vLLM's response: ``{answer_p_wrong, steps: [{text, token_start,
token_end, p_wrong}], head, rows?}``. Streaming: a chunk that completes a step of a choice carries
``uncertainty: {steps: [that step]}`` for it; the chunk with the choice's ``finish_reason``
carries the full object. ``stop_above``: a choice the service stopped gets ``finish_reason``
"stop_above"; ``keep_below``: the response keeps the choices under it (:func:`keep_below`), a
stream marks each choice's last chunk ``kept``.
"""

from __future__ import annotations

import json
import logging
import math
import re
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
                if "stopped_by" in obj:
                    choice.finish_reason = obj["stopped_by"]
                setattr(choice, "uncertainty", obj)
            if spec.keep_below is not None:
                keep_below(result, record, spec.keep_below)
        except BadUncertaintyRequest as exc:
            return handler.create_error_response(str(exc))
        finally:
            service.release_soon(record, early=False)
        return result

    setattr(handler, method, create)


def passes(obj: dict, keep_below: float) -> bool:
    """A choice's answer P(wrong) is below ``keep_below`` (no score: it does not pass)."""
    p = obj.get("answer_p_wrong")
    return p is not None and p < keep_below


def keep_below(result: Any, record: RequestRecord, threshold: float) -> None:
    """Keep the choices whose answer P(wrong) is below ``threshold``, per prompt, in their order and
    with their indices; where none of a prompt's choices passes, keep its one with the lowest answer
    P(wrong) (``kept: false``), so no prompt goes unanswered. The response says what was dropped."""
    by_prompt: dict[int, list[Any]] = {}
    for c in result.choices:
        by_prompt.setdefault(record.locate(c.index)[0], []).append(c)
    kept: set[int] = set()
    for choices in by_prompt.values():
        good = [c for c in choices if passes(c.uncertainty, threshold)]
        for c in good:
            c.uncertainty["kept"] = True
        if not good:
            best = min(choices, key=_rank)
            best.uncertainty["kept"] = False
            good = [best]
        kept.update(c.index for c in good)
    dropped = [{"index": c.index, "answer_p_wrong": c.uncertainty.get("answer_p_wrong"),
                "finish_reason": c.finish_reason} for c in result.choices if c.index not in kept]
    result.choices = [c for c in result.choices if c.index in kept]
    setattr(result, "uncertainty", {"keep_below": threshold, "dropped": dropped})


def _rank(choice: Any) -> tuple[bool, float, int]:
    """Lowest answer P(wrong) first, unscored last, then the lower index."""
    p = choice.uncertainty.get("answer_p_wrong")
    return (p is None, p if p is not None else 0.0, choice.index)


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


#: A chunk in which some choice finished (vLLM writes ``"finish_reason":null`` for running ones).
_FINISHED = re.compile(r'"finish_reason":\s*"')


def _has_news(text: str, record: RequestRecord) -> bool:
    """Whether a chunk can get uncertainty: a choice finished in it, or a running choice has
    scored steps or an error not yet sent. Most chunks have none and pass unparsed."""
    return bool(_FINISHED.search(text)) or any(
        s.pending_steps or (s.step_error and not s.error_sent) for p in record.prompts for s in p.seqs.values())


async def _annotate(text: str, record: RequestRecord, service: UncertaintyService) -> str:
    if not _has_news(text, record):
        return text
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
                    if "stopped_by" in obj:
                        choice["finish_reason"] = obj["stopped_by"]
                    if record.spec.keep_below is not None:  # a stream cannot take text back: it says
                        obj["kept"] = passes(obj, record.spec.keep_below)
                    choice["uncertainty"] = obj
                    touched = True
                elif (part := _running_part(record, idx)) is not None:
                    choice["uncertainty"] = part
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


def _running_part(record: RequestRecord, idx: int) -> dict | None:
    """What a mid-stream chunk of choice ``idx`` carries: the steps the tap scored since the last
    one (:meth:`UncertaintyService.watch`), or once why scoring the running choice failed."""
    prompt_index, sample = record.locate(idx)
    s = record.prompts[prompt_index].seqs.get(sample) if prompt_index < len(record.prompts) else None
    if s is None:
        return None
    if s.pending_steps:
        steps, s.pending_steps = s.pending_steps, []
        return {"steps": finite_scores(steps)}
    if s.step_error and not s.error_sent:
        s.error_sent = True
        return {"error": s.step_error}
    return None
