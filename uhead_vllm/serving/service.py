"""Per-request uncertainty work inside the API server: fetch this request's rows, make them
exact, score them, encode the rows a client asked for.

One instance per server. It holds the row completion (the generator's: row store, recompute; see
generation/completion.py) and the registry of running uncertainty requests; all of it runs on the
server's event loop, so no locks are needed. Rows cross the process boundary only as safetensors
bytes through the engine's one capture client (its async face, ``make_capture_client``), never pickled; every exit path of a recompute (a client leaving
included) takes its rows out of the worker.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import uuid
from typing import Any, cast

import torch
from safetensors.torch import save as st_save

from ..adapters.server import abort_sample
from ..capture.points import site_name
from ..capture.protocol import CapturedRows, CaptureSettings
from ..generation.backends import AsyncCaptureClient, make_capture_client
from ..generation.completion import Recompute, RowCompletion, SequenceRows, rows_from
from .record import RequestRecord, new_tag
from .scoring import Scorer
from .spec import BadUncertaintyRequest, ServerLimits, UncertaintySpec
from .takes import TakeQueue

_BACKGROUND: set[asyncio.Task] = set()
logger = logging.getLogger("uhead_vllm.serving")


class UncertaintyService:
    """Everything between vLLM's OpenAI handlers and the worker's captured rows."""

    def __init__(self, engine: Any, scorer: Scorer | None, settings: CaptureSettings, hidden_size: int,
                 block_size: int, max_rows_bytes: int, store_bytes: int, num_layers: int = 0):
        self.engine = engine  # the real engine client (not the tap)
        # An AsyncLLM's client: the async face (rows by tag, the worker's status).
        self.capture = cast(AsyncCaptureClient, make_capture_client(engine))
        self.scorer = scorer
        self.settings = settings  # what the worker captures: layers, then points (serve --points), dtype, steering
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.completion = RowCompletion(block_size, store_bytes, new_tag)
        self.limits = ServerLimits(settings.layers, hidden_size, scorer.name if scorer else None, max_rows_bytes,
                                   settings.points, reduced=bool(settings.token_inputs))
        self.registry: dict[str, RequestRecord] = {}
        # Rows of running requests, and the last take that forgets a request: one RPC per round.
        self._takes = TakeQueue(self.capture.take_tags, forget=False)
        self._forgets = TakeQueue(self.capture.take_tags, forget=True)
        self.counters = {"requests": 0, "rows_from_store": 0, "rows_recomputed": 0, "recompute_requests": 0,
                         "capture_errors": 0, "released_early": 0, "stopped_choices": 0,
                         "aborted_choices": 0}

    # ------------------------------------------------------------------ lifecycle
    def open(self, spec: UncertaintySpec, salt: str = "", steer_args: dict | None = None) -> RequestRecord:
        logprobs = 0
        if spec.steps:
            assert self.scorer is not None  # the spec refuses steps on a server without a head
            logprobs = self.scorer.logprobs_needed
        record = RequestRecord(uuid.uuid4().hex, spec, logprobs, salt, steer_args)
        self.registry[record.key] = record
        self.counters["requests"] += 1
        return record

    async def release(self, record: RequestRecord) -> None:
        """Forget a request: drop its rows here and in the worker, stop recording its tags."""
        self.registry.pop(record.key, None)
        if record.tags:
            await self._forgets.take(record.tags, 0, lambda rows: None)

    def release_soon(self, record: RequestRecord, early: bool = True) -> None:
        """Release as a task of its own: from a context that may be cancelled (a client gone),
        or after a response without waiting for the worker. ``early``: the request did not get its
        answer (counted as ``released_early``)."""
        if early:
            self.counters["released_early"] += 1
        task = asyncio.ensure_future(self.release(record))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    async def fetch(self, record: RequestRecord) -> None:
        """Move the rows the worker recorded for this request so far into its record."""
        if record.tags:
            await self._takes.take(record.tags, record.rows_expected(), lambda rows: self._add_rows(record, rows))

    def _add_rows(self, record: RequestRecord, rows: CapturedRows) -> None:
        if rows.error:
            self.counters["capture_errors"] += 1
        record.add_rows(rows)

    async def _fetch_tags(self, tags: list[int], forget: bool = False, expect_rows: int = 0) -> CapturedRows:
        """The rows of ``tags``; through shared memory when the caller says how many to expect."""
        return await self.capture.take_tags(tags, forget, expect_rows)

    def _forget_soon(self, tags: list[int]) -> None:
        """Take ``tags``' rows out of the worker and stop recording them, as a task of its own (the
        caller may be cancelled: a client gone)."""
        task = asyncio.ensure_future(self._fetch_tags(tags, forget=True))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # an engine gone: nothing to free

    async def _recompute(self, requests: list[Recompute]) -> CapturedRows:
        """Forward the completion's recompute requests and take back their rows. On every other
        exit (a client gone, an engine error) their rows still leave the worker: vLLM aborts a
        request whose output stream is closed, and the forget follows the abort in the engine's
        input queue."""
        tags = [r.tag for r in requests]
        taken = False
        try:
            await asyncio.gather(*(self._run(r) for r in requests))
            expect = sum(len(r.prompt["prompt_token_ids"]) for r in requests)
            rows = await self._fetch_tags(tags, forget=True, expect_rows=expect)
            taken = True
        finally:
            if not taken:
                self._forget_soon(tags)
        self.counters["recompute_requests"] += len(requests)
        return rows

    async def _run(self, request: Recompute) -> None:
        outputs = self.engine.generate(request.prompt, request.params, f"uhead-recompute-{request.tag}")
        try:
            async for _ in outputs:
                pass
        finally:
            await outputs.aclose()  # closing vLLM's generator aborts the request now, not at GC

    # ------------------------------------------------------------------ one sequence
    async def sequence_rows(self, record: RequestRecord, prompt_index: int, sample: int,
                            need_from: int | None) -> tuple[torch.Tensor, int]:
        """Exact rows ``[num_rows, columns, H]`` (the layers, then the points) of one finished
        sequence and its prompt length, completed from the row store or a recompute where the
        engine skipped rows. ``need_from``: first position that must be exact (0 for returned
        rows, None = the prompt length, for scoring)."""
        p = record.prompts[prompt_index]
        s = p.seqs[sample]
        prompt = p.prompt_token_ids or []
        expected = torch.tensor(prompt + s.token_ids, dtype=torch.int64)
        num_rows = max(len(expected) - 1, 0)
        start = len(prompt) if need_from is None else need_from
        seq = SequenceRows.captured(expected, num_rows, record.captured(p.tag, sample), self.settings.num_columns,
                                    self.hidden_size, self.settings.torch_dtype, salt=record.salt,
                                    cache_salt=record.salt, steer_args=record.steer_args, need_from=start)
        done = await self.completion.complete_async([seq], self._recompute)
        self.counters["rows_from_store"] += done.rows_from_store
        self.counters["rows_recomputed"] += done.rows_recomputed
        return seq.rows, len(prompt)

    def running_rows(self, record: RequestRecord, prompt_index: int, sample: int) -> torch.Tensor:
        """The generated rows ``[T - 1, columns, H]`` of a running sequence of ``T`` tokens so far
        (a row exists once its token was fed back), from what the worker sent; nothing is completed
        while it runs. Raises RuntimeError where one is missing (the final object completes it)."""
        p = record.prompts[prompt_index]
        generated = torch.tensor(p.seqs[sample].token_ids, dtype=torch.int64)
        rows = rows_from(generated, len(p.prompt_token_ids or ()), record.captured(p.tag, sample),
                         self.settings.num_columns, self.hidden_size, self.settings.torch_dtype)
        if rows is None:
            raise RuntimeError("rows of a running sequence are missing")
        return rows

    async def choice_uncertainty(self, record: RequestRecord, choice_index: int) -> dict[str, Any]:
        """The ``uncertainty`` object of one finished choice."""
        prompt_index, sample = record.locate(choice_index)
        spec = record.spec
        rows, prompt_len = await self.sequence_rows(record, prompt_index, sample, 0 if spec.rows else None)
        s = record.prompts[prompt_index].seqs[sample]
        out: dict[str, Any] = {}
        if spec.steps:
            assert self.scorer is not None  # the spec refuses steps on a server without a head
            generated = rows[prompt_len:, : len(self.settings.layers)]  # the head reads layer columns
            scored = self.scorer.score(s.token_ids, s.logprobs, s.text, s.finish_reason, generated)
            if spec.features:
                pooled = self.scorer.pooled_features(s.token_ids, s.logprobs, generated, scored["steps"])
                for step, vector in zip(scored["steps"], pooled):
                    step["features"] = vector
            out.update(scored)
            out["head"] = self.scorer.name
            if s.stopped_step is not None and s.finish_reason == "abort":  # ended by stop_above, not on its own
                out["stopped_by"] = "stop_above"
                out["stop_step"] = s.stopped_step
        if spec.rows:
            prompt_ids = record.prompts[prompt_index].prompt_token_ids
            assert prompt_ids is not None  # set by the prompt's first output
            out["rows"] = self._encode_rows(rows, prompt_ids + s.token_ids, spec)
        return out

    # ------------------------------------------------------------------ running choices
    async def watch(self, record: RequestRecord, prompt_index: int, output: Any) -> None:
        """The tap's hook, on each engine output of an uncertainty request before vLLM's handler
        sees it: score the steps of each running sequence that this output completed (streams:
        they go out with the chunk made from it; ``stop_above``: a step that reaches the threshold
        aborts that sequence in vLLM now). A failure here never breaks the answer."""
        spec = record.spec
        p = record.prompts[prompt_index]
        if not spec.steps or not (p.delta or spec.stop_above is not None):
            return
        for o in output.outputs:
            s = p.seqs.get(o.index)
            if s is None or s.finish_reason is not None or s.stopped_step is not None or s.step_error:
                continue
            try:
                await self._score_running(record, prompt_index, o.index)
            except Exception as exc:  # the final object scores the choice again (or says why not)
                logger.exception("scoring running choice %s/%s failed", prompt_index, o.index)
                s.step_error = f"{type(exc).__name__}: {exc}"
                continue
            if s.stopped_step is not None:
                self.counters["stopped_choices"] += 1
                try:
                    if await abort_sample(self.engine, p.request_id, o.index):
                        self.counters["aborted_choices"] += 1
                except Exception:  # the choice runs to its end; its steps still say what happened
                    logger.exception("aborting choice %s/%s failed", prompt_index, o.index)

    async def _score_running(self, record: RequestRecord, prompt_index: int, sample: int) -> None:
        """Score the steps of one running sequence completed since the last call (each step once);
        re-split only after a possible step end (splitting decodes). The flag stays up until the
        step after the end has begun and was scored."""
        assert self.scorer is not None  # the spec refuses steps on a server without a head
        s = record.prompts[prompt_index].seqs[sample]
        new_text, s.text_seen = s.text[s.text_seen :], len(s.text)
        if new_text and self.scorer.step_boundary_possible(new_text):
            s.boundary_pending = True
        if not s.boundary_pending:
            return
        before = s.steps_scored
        steps = await self.running_steps(record, prompt_index, sample)
        if s.steps_scored > before:
            s.boundary_pending = False
        s.pending_steps += steps
        limit = record.spec.stop_above
        if limit is not None:
            for k, step in enumerate(steps):
                if step["p_wrong"] is not None and step["p_wrong"] >= limit:
                    s.stopped_step = before + k
                    break

    async def running_steps(self, record: RequestRecord, prompt_index: int, sample: int) -> list[dict[str, Any]]:
        """Scores of the steps of a running sequence that completed since the last call: a step is
        complete once the next has begun (its last token's row exists from then on)."""
        s = record.prompts[prompt_index].seqs[sample]
        assert self.scorer is not None  # the spec refuses steps on a server without a head
        if s.offsets is None:
            s.offsets = self.scorer.answer_offsets()
        spans = self.scorer.final_spans(s.token_ids, s.offsets)
        if len(spans) <= s.steps_scored:
            return []
        await self.fetch(record)
        try:
            rows = self.running_rows(record, prompt_index, sample)
        except RuntimeError:
            s.steps_scored = len(spans)  # a row is missing (e.g. preempted): the final object has them
            return []
        new = self.scorer.score_spans(s.token_ids, s.logprobs[: len(s.token_ids)],
                                      rows[:, : len(self.settings.layers)], spans[s.steps_scored :])
        s.steps_scored = len(spans)
        return new

    def _encode_rows(self, rows: torch.Tensor, token_ids: list[int], spec: UncertaintySpec) -> dict[str, Any]:
        assert spec.rows is not None  # called for a request that asks for rows
        n_layers = len(self.settings.layers)
        idx = ([self.settings.layers.index(k) for k in spec.rows.layers]
               + [n_layers + self.settings.points.index(s) for s in spec.rows.points])
        dtype = torch.float32 if spec.rows.dtype == "float32" else torch.bfloat16
        hidden = rows[:, idx].to(dtype).contiguous()
        points = [site_name(s) for s in spec.rows.points]
        payload = st_save({"hidden": hidden, "token_ids": torch.tensor(token_ids[: rows.shape[0]], dtype=torch.int64)},
                          metadata={"layers": json.dumps(list(spec.rows.layers)), "points": json.dumps(points)})
        return {"layers": list(spec.rows.layers), "points": points, "dtype": spec.rows.dtype,
                "num_rows": int(rows.shape[0]),
                "format": "safetensors", "safetensors_b64": base64.b64encode(payload).decode("ascii"),
                "raw_bytes": hidden.numel() * hidden.element_size()}

    @staticmethod
    def check_rows_size(record: RequestRecord, objects: list[dict[str, Any]]) -> None:
        """Refuse a response whose rows (prompt rows included) exceed the request's budget."""
        total = sum(o.get("rows", {}).get("raw_bytes", 0) for o in objects)
        if record.spec.rows and total > record.spec.max_bytes:
            raise BadUncertaintyRequest(
                f"rows budget exceeded: the rows of this response take {total} bytes (prompt rows "
                f"included) > max_bytes {record.spec.max_bytes}; ask for fewer layers or points, bfloat16 or a "
                "larger max_bytes")

    async def status(self) -> dict[str, Any]:
        """Memory and counters: what the server and the worker hold now (for tests and ops). With
        several API server processes (``--api-server-count``) the server's part is the answering
        process's (``process_id``); the worker's is the engine's."""
        worker = await self.capture.status()
        return {"process_id": os.getpid(), "running_requests": len(self.registry), "worker_bytes_held": worker.get("bytes_held", 0),
                "worker_tags_refused": {k: v for k, v in worker.items() if k.startswith("tags_")},
                "worker_engine_time": worker.get("engine_time", {}),  # RowRecorder.engine_time
                "server_bytes_held": sum(r.bytes_held() for r in self.registry.values()),
                "store_bytes": self.completion.store.bytes_held, "store_blocks": len(self.completion.store),
                "captured_layers": list(self.settings.layers),
                "captured_points": [site_name(s) for s in self.settings.points], "head": self.limits.head_name,
                **self.counters, **self.capture.counters,
                "row_takes": self._takes.rounds + self._forgets.rounds,
                "row_take_callers": self._takes.callers + self._forgets.callers}
