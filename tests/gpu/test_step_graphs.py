"""The recorder's step copies replayed as CUDA graphs (capture/step_graphs.py) write exactly what
the eager copies write; skipped where no GPU is present (CI)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_steady_layout_seen_twice_is_captured_and_replays_read_the_sources_current_values():
    from uhead_vllm.capture.step_batch import _copy_all
    from uhead_vllm.capture.step_graphs import StepGraphs

    dev = torch.device("cuda")
    n, hidden, slots = 8, 64, 4
    rows = torch.zeros((slots * n, 3, hidden), dtype=torch.bfloat16, device=dev)
    meta = torch.zeros((2, slots * n), dtype=torch.int64, device=dev)
    aux = [torch.empty((16, hidden), dtype=torch.bfloat16, device=dev) for _ in range(3)]  # padded, fixed
    pos = torch.empty(16, dtype=torch.int64, device=dev)
    ids = torch.empty(16, dtype=torch.int32, device=dev)  # converted to int64 by the copy
    graphs = StepGraphs(_copy_all)
    steps = 40
    for step in range(steps):
        for t in aux:
            t.normal_()
        pos.copy_(torch.arange(16, device=dev) + step)
        ids.copy_(torch.randint(0, 50_000, (16,), device=dev, dtype=torch.int32))
        o = (step % slots) * n
        targets = [*rows[o : o + n].unbind(1), *meta[:, o : o + n].unbind(0)]
        graphs.copy(("buffer", o, n), targets, [t[:n] for t in (*aux, pos, ids)])
        torch.cuda.synchronize()
        assert torch.equal(rows[o : o + n], torch.stack([t[:n] for t in aux], dim=1)), step
        assert torch.equal(meta[0, o : o + n], pos[:n]) and torch.equal(meta[1, o : o + n], ids[:n].long()), step
    assert graphs.enabled and graphs.captured == slots
    # Each layout's first steady sighting is copied eagerly, and so is the first step (no step
    # before it to repeat).
    assert graphs.replayed == steps - slots - 1

    moved = [t.clone() for t in aux]  # same shapes at other addresses: a new layout, copied eagerly
    graphs.copy(("buffer", 0, n), [*rows[:n].unbind(1), *meta[:, :n].unbind(0)], [t[:n] for t in (*moved, pos, ids)])
    torch.cuda.synchronize()
    assert torch.equal(rows[:n], torch.stack([t[:n] for t in moved], dim=1))
    assert graphs.captured == slots


def test_recorded_decode_steps_from_fixed_buffers_land_exactly_with_graph_replays(monkeypatch):
    """vLLM's FULL graphs leave each step's outputs in the same buffers: after a few steps the
    recorder's copies replay as graphs, and every row still reaches its slot with its token."""
    from uhead_vllm.adapters import ScheduledStep, StepOutputs
    from uhead_vllm.capture import step_batch
    from uhead_vllm.capture.destination import RowDestination
    from uhead_vllm.capture.protocol import CaptureSettings, RequestTag
    from uhead_vllm.capture.recorder import RowRecorder

    monkeypatch.setattr(step_batch, "MAX_STEPS", 3)
    dev = torch.device("cuda")
    hidden, prompt, decode, k = 32, 6, 40, 4
    capacity = prompt + decode
    rec = RowRecorder(CaptureSettings(layers=(0, 2), dtype="bfloat16"), aux_layers=(0, 1, 2), hidden_size=hidden)
    dest = RowDestination(torch.full((k * capacity, 2, hidden), -1.0, dtype=torch.bfloat16),
                          {t: (t * capacity, capacity) for t in range(k)})
    rec.place_into(dest)
    req_ids = [f"r{t}" for t in range(k)]
    padded = k * prompt
    aux = [torch.zeros((padded, hidden), dtype=torch.bfloat16, device=dev) for _ in range(3)]
    pos = torch.zeros(padded, dtype=torch.int64, device=dev)
    ids = torch.zeros(padded, dtype=torch.int32, device=dev)

    def value(layer: int, req: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return (layer * 100 + req * 20 + p).to(torch.bfloat16)[:, None].expand(-1, hidden)

    for step in range(decode + 1):
        new = [(r, RequestTag(t, 0).to_extra_args()) for t, r in enumerate(req_ids)] if not step else []
        n = prompt if not step else 1
        rec.on_schedule(ScheduledStep(new, {r: n for r in req_ids}, set()))
        start = 0 if not step else prompt + step - 1
        p = torch.arange(start, start + n, device=dev).repeat(k)
        req = torch.arange(k, device=dev).repeat_interleave(n)
        for j, t in enumerate(aux):  # written in place, as a graph replay leaves them
            t[: k * n] = value(j, req, p)
        pos[: k * n] = p
        ids[: k * n] = (p + 1000 * req).to(torch.int32)
        rec.on_forward(StepOutputs(req_ids, np.arange(k + 1, dtype=np.int32) * n, pos, ids, aux))
    graphs = rec._batcher.graphs
    rows = rec.take()
    assert rows.error is None and rows.num_rows == k * capacity
    assert graphs is not None and graphs.enabled and rows.stats["forwards_replayed"] > decode // 2
    assert graphs.replayed == 0  # counted per generation: the take reset it
    for t in range(k):
        q, p = torch.full((capacity,), t), torch.arange(capacity)
        want = torch.stack([value(j, q, p) for j in (0, 2)], dim=1)
        assert torch.equal(dest.buffer[t * capacity : (t + 1) * capacity], want), t
        assert dest.tokens[t * capacity : (t + 1) * capacity].tolist() == (p + 1000 * t).tolist()
