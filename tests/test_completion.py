"""The one row completion (generation/completion.py) the generator and the server share, without an
engine: rows come from the store only under the same cache salt, both faces complete alike, and a
server recompute its client leaves takes its rows out of the worker."""

from __future__ import annotations

import asyncio
import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from uhead_vllm.adapters import ScheduledStep, StepOutputs
from uhead_vllm.capture.protocol import CapturedRows, CaptureSettings, RequestTag, encode_rows
from uhead_vllm.capture.recorder import RowRecorder
from uhead_vllm.generation.completion import Recompute, RowCompletion, SequenceRows
from uhead_vllm.generation.steering import CAPTURE_CACHE_SALT, steer_request, step_key

COLUMNS, WIDTH, BLOCK = 2, 3, 4
IDS = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], dtype=torch.int64)  # 10 rows: 2 full blocks


def truth(ids: torch.Tensor, n: int) -> torch.Tensor:
    """Rows as a model would make them: row p depends on every token up to p."""
    ref = torch.cumsum(ids[:n].double(), 0) + torch.arange(n)
    return (ref[:, None, None] * torch.tensor([1.0, -2.0])[:, None] + torch.arange(WIDTH)).float()


def forward(requests: list[Recompute]) -> CapturedRows:
    """The engine as completion sees it: every position of each request forwarded and recorded."""
    parts, tags, positions, token_ids = [], [], [], []
    for r in requests:
        ids = torch.tensor(r.prompt["prompt_token_ids"])
        parts.append(truth(ids, len(ids)))
        tags += [RequestTag.from_extra_args(r.params.extra_args).tag] * len(ids)
        positions.append(torch.arange(len(ids)))
        token_ids.append(ids)

    def z(t: list[int]) -> torch.Tensor:
        return torch.tensor(t, dtype=torch.int64)

    n = sum(len(p) for p in parts)
    return CapturedRows((0, 2), parts, z(tags), torch.zeros(n, dtype=torch.int64), torch.cat(positions),
                        torch.cat(token_ids), z([0, n]))


def sequence(salt: str, valid_from: int = 0, need_from: int = 0) -> SequenceRows:
    """The sequence IDS with rows before ``valid_from`` missing (its prompt blocks prefix-cached)."""
    rows = torch.full((10, COLUMNS, WIDTH), float("nan"))
    rows[valid_from:] = truth(IDS, 10)[valid_from:]
    valid = torch.arange(10) >= valid_from
    return SequenceRows(IDS, 10, rows, valid, salt=salt, cache_salt=salt, need_from=need_from)


def run(completion: RowCompletion, seq: SequenceRows, face: str, sent: list[Recompute]):
    def spy(requests):
        sent.extend(requests)
        return forward(requests)

    async def spy_async(requests):
        return spy(requests)

    if face == "sync":
        return completion.complete([seq], spy)
    return asyncio.run(completion.complete_async([seq], spy_async))


@pytest.mark.parametrize("face", ["sync", "async"])
def test_rows_come_from_the_store_only_under_the_same_salt(face):
    completion = RowCompletion(BLOCK, 1 << 20, itertools.count().__next__)
    sent: list[Recompute] = []
    first = sequence("client-a:x")
    assert run(completion, first, face, sent).rows_from_store == 0 and not sent  # complete: only stored
    for salt in ("client-b:x", "", "client-a"):  # another client's salt, none, a prefix of it
        other = sequence(salt, valid_from=8)
        done = run(completion, other, face, sent)
        assert done.rows_from_store == 0 and done.recompute_requests == 1 and done.rows_recomputed == 8
        assert sent[-1].prompt.get("cache_salt", "") == salt and sent[-1].params.skip_reading_prefix_cache
        assert torch.equal(other.rows, truth(IDS, 10))
    again = sequence("client-a:x", valid_from=8)
    done = run(completion, again, face, sent)
    assert done.rows_from_store == 8 and done.recompute_requests == 0 and len(sent) == 3
    assert torch.equal(again.rows, truth(IDS, 10))


def test_both_faces_complete_alike_and_rows_before_need_from_may_stay_missing():
    results = {}
    for face in ("sync", "async"):
        completion = RowCompletion(BLOCK, 1 << 20, itertools.count().__next__)
        run(completion, sequence("s"), face, [])
        seqs = [sequence("s", valid_from=6), sequence("t", valid_from=3)]
        done = [run(completion, q, face, []) for q in seqs]
        results[face] = ([q.rows for q in seqs], [(d.rows_from_store, d.rows_recomputed) for d in done])
    assert results["sync"][1] == results["async"][1] == [(6, 0), (0, 3)]  # rows 0-5 in stored blocks; "t" another salt
    for a, b in zip(results["sync"][0], results["async"][0]):
        assert torch.equal(a, b) and torch.equal(a, truth(IDS, 10))
    # a server scoring generated rows only (need_from = prompt length): prompt rows are not made
    completion = RowCompletion(BLOCK, 1 << 20, itertools.count().__next__)
    scored = sequence("s", valid_from=8, need_from=8)
    done = run(completion, scored, "async", [])
    assert (done.rows_from_store, done.recompute_requests) == (0, 0) and not scored.valid[:8].any()


def test_a_clients_cache_salt_keys_kv_blocks_rows_and_steps():
    def request(vllm_input, steer=None):
        extra = {"uhead_steer": [{"point": "mlp_out", "layer": 1, "vector": [0.5] * 4}]} if steer else None
        return steer_request(extra, vllm_input, "text", index=0, engine_steers=True, num_layers=2, hidden_size=4,
                             tokenize=lambda text: [1, 2])

    plain = request({"prompt_token_ids": [1, 2]})
    assert (plain.salt, plain.cache_salt, plain.step_salt) == ("", CAPTURE_CACHE_SALT, "")  # as before
    a = request({"prompt_token_ids": [1, 2], "cache_salt": "a"})
    b = request({"prompt_token_ids": [1, 2], "cache_salt": "b"})
    assert a.cache_salt == a.salt == f"a:{CAPTURE_CACHE_SALT}" and b.salt == f"b:{CAPTURE_CACHE_SALT}"
    steered = request({"prompt_token_ids": [1, 2]}, True)
    steered_a = request({"prompt_token_ids": [1, 2], "cache_salt": "a"}, True)
    assert steered_a.salt == f"a:{steered.salt}" and steered_a.cache_salt == steered_a.salt
    step_keys = {step_key("p", r.step_salt) for r in (plain, a, b, steered, steered_a)}
    assert len(step_keys) == 5 and len({r.salt for r in (plain, a, b, steered, steered_a)}) == 5


class _Worker:
    """The engine client as the server's service uses it: ``generate`` streams a request (here it
    records the request's rows in a real recorder, then runs until it is closed) and
    ``collective_rpc`` reaches the worker's recorder."""

    def __init__(self, recorder: RowRecorder):
        self.recorder = recorder
        self.running = asyncio.Event()
        self.closed: list[str] = []

    async def collective_rpc(self, method: str, args: tuple = ()):
        if method == "uhead_take":
            tags, forget, inline = args
            assert not inline  # the server's engine core is another process: rows travel as bytes
            return [encode_rows(self.recorder.take_tags(list(tags), forget=forget))]
        return [json.dumps({"recording": True, "bytes_held": self.recorder.bytes_held})]

    async def generate(self, prompt: dict, params, request_id: str):
        ids = prompt["prompt_token_ids"]
        self.recorder.on_schedule(ScheduledStep([(request_id, params.extra_args)], {request_id: len(ids)}, set()))
        aux = [torch.ones(len(ids), WIDTH) * k for k in range(2)]
        self.recorder.on_forward(StepOutputs([request_id], np.array([0, len(ids)]), torch.arange(len(ids)),
                                             torch.tensor(ids), aux))
        self.running.set()
        try:
            await asyncio.Event().wait()  # a long recompute
            yield None
        finally:
            self.closed.append(request_id)


def test_a_client_leaving_during_a_recompute_leaves_no_rows_in_the_worker():
    from uhead_vllm.serving.record import RequestRecord
    from uhead_vllm.serving.service import UncertaintyService
    from uhead_vllm.serving.spec import UncertaintySpec

    async def scenario():
        recorder = RowRecorder(CaptureSettings((0, 2)), (0, 2), WIDTH)
        worker = _Worker(recorder)
        service = UncertaintyService(worker, None, CaptureSettings((0, 2)), WIDTH, BLOCK, 1 << 20, 1 << 20)
        record = RequestRecord("k", UncertaintySpec(), 0)
        record.new_prompt(1, False)
        out = SimpleNamespace(index=0, token_ids=[30, 31, 32], logprobs=None, text="abc", finish_reason="stop")
        record.observe(0, SimpleNamespace(prompt_token_ids=list(range(1, 9)), outputs=[out]))
        task = asyncio.ensure_future(service.sequence_rows(record, 0, 0, 0))  # no row captured: recompute
        await worker.running.wait()
        assert recorder.bytes_held > 0
        task.cancel()  # the client is gone
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(10):
            await asyncio.sleep(0)
        status = await service.status()
        return recorder, worker, status

    recorder, worker, status = asyncio.run(scenario())
    assert worker.closed and recorder.bytes_held == 0 and status["worker_bytes_held"] == 0
    # the request's tag is forgotten: rows recorded for it afterwards are not kept
    rid = worker.closed[0]
    recorder.on_schedule(ScheduledStep([], {rid: 1}, set()))
    recorder.on_forward(StepOutputs([rid], np.array([0, 1]), torch.arange(1), torch.tensor([1]),
                                    [torch.ones(1, WIDTH)] * 2))
    assert recorder.bytes_held == 0
