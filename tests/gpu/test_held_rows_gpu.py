"""A server's row takes on a GPU never wait for a forward that still runs (capture/sinks/held.py),
with real CUDA events: a step whose gathers are queued behind a long kernel stays held, the take
returns at once with the finished steps' rows, and the next take brings the rest, exact. Skipped
where no GPU is present (tests/test_serving_units.py checks the same bookkeeping on the host)."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _forward(rec, reqs: dict[str, int], new: dict, base: float) -> list[torch.Tensor]:
    from uhead_vllm.adapters import ScheduledStep, StepOutputs

    rec.on_schedule(ScheduledStep(new_requests=list(new.items()), finished_req_ids=set(), num_scheduled_tokens=reqs))
    qsl = np.concatenate([[0], np.cumsum(list(reqs.values()))])
    total = int(qsl[-1])
    aux = [base + torch.arange(total * 4, dtype=torch.float32, device="cuda").view(total, 4) + 1000 * k for k in range(2)]
    rec.on_forward(StepOutputs(req_ids=list(reqs), query_start_loc=qsl, aux=aux,
                               positions=torch.arange(total, device="cuda"), input_ids=torch.arange(total, device="cuda")))
    return aux


def test_a_take_leaves_a_running_forwards_rows_and_the_next_take_brings_them():
    from uhead_vllm.capture.protocol import CaptureSettings, RequestTag
    from uhead_vllm.capture.recorder import RowRecorder

    rec = RowRecorder(CaptureSettings((0, 2), "float32"), (0, 2), 4)
    tags = {"a": RequestTag(1, 0).to_extra_args(), "b": RequestTag(2, 0).to_extra_args()}
    done = _forward(rec, {"a": 3, "b": 2}, tags, 0.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time ahead of the next forward's gathers
    running = _forward(rec, {"a": 1, "b": 1}, {}, -10_000.0)
    start = time.perf_counter()
    first = rec.take_tags([1, 2])
    seconds = time.perf_counter() - start
    assert rec.held.running and not rec.held.running[0].computed.query(), \
        "the long kernel ended before the take: nothing was tested"
    assert seconds < 0.2, f"the take waited {seconds:.2f} s for a running forward"
    assert first.num_rows == 5 and torch.equal(first.hidden[:, 0], done[0].cpu()) and torch.equal(first.hidden[:, 1], done[1].cpu())
    rec.take_tags([2], forget=True)  # tag 2's row of the running step goes at once
    assert rec.bytes_held == 1 * 2 * 4 * 4
    torch.cuda.synchronize()
    second = rec.take_tags([1, 2])
    assert second.tags.tolist() == [1] and torch.equal(second.hidden[0, 0], running[0][0].cpu())
    assert rec.bytes_held == 0
