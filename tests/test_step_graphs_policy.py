"""When the recorder's step copies are captured as graphs (capture/step_graphs.py): only where
graphs pay. The capture itself needs a GPU (tests/gpu/test_step_graphs.py); here a stand-in graph
that replays the copy it was made for checks the bookkeeping and that every copy lands."""

from __future__ import annotations

import torch

from uhead_vllm.capture import step_graphs
from uhead_vllm.capture.step_graphs import FREE_CAPTURES, REPLAYS_PER_CAPTURE, StepGraphs


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    for t, s in zip(targets, sources):
        t.copy_(s)


class _Replay:
    """Stands in for a CUDA graph: replays the copy of the tensors it was captured with."""

    def __init__(self, targets: list[torch.Tensor], sources: list[torch.Tensor]):
        self.targets, self.sources = targets, sources

    def replay(self) -> None:
        _copy_all(self.targets, self.sources)


class _HostGraphs(StepGraphs):
    def _graph_of(self, targets, sources):  # noqa: ANN001  (the real bookkeeping around it, no CUDA)
        return _Replay(targets, sources)


def _copy(graphs: StepGraphs, layout: int, target: torch.Tensor, sources: dict[int, torch.Tensor],
          source_of: int | None = None) -> None:
    """One step's copy into layout ``layout``'s target from source ``source_of`` (default: the
    layout's own source tensor), checked to have landed."""
    source = sources.setdefault(layout if source_of is None else source_of, torch.empty(4))
    source.normal_()
    graphs.copy(("buffer", layout), [target], [source])
    assert torch.equal(target, source)


def test_steady_layouts_are_captured_on_their_second_sighting_and_replayed_after():
    """Decode steps of an unchanged batch: the same sources, written at offset after offset."""
    graphs, target, sources = _HostGraphs(_copy_all), torch.empty(4), {}
    for _ in range(10):
        for layout in range(32):
            _copy(graphs, layout, target, sources, source_of=0)
    assert graphs.captured == 32
    # All but each layout's first steady sighting (the very first step has no step before it,
    # so layout 0 is first seen steady in the second round).
    replays = 32 * 9 - 1
    assert graphs.replays_total == graphs.replayed == replays
    assert graphs.take_replayed() == replays and graphs.replayed == 0  # per generation; the total stays
    assert graphs.replays_total == replays


def test_layouts_that_change_sources_from_the_step_before_stay_eager():
    """Prefill chunks and the steps where the batch changes recur at most once a generation: never
    captured, however often they come back, and every copy lands."""
    graphs, target, sources = _HostGraphs(_copy_all), torch.empty(4), {}
    for _ in range(50):
        for layout in (1, 2, 3):  # each from a source of its own: never the previous step's
            _copy(graphs, layout, target, sources)
    assert graphs.captured == 0 and graphs.replays_total == 0


def test_layouts_that_never_recur_stop_being_captured_until_replays_pay_again():
    graphs, target, sources = _HostGraphs(_copy_all), torch.empty(4), {}
    for layout in range(1000, 1300):  # each seen as a steady step exactly twice (its first copy follows
        for _ in range(3):            # another layout's): a capture that is never replayed again
            _copy(graphs, layout, target, sources)
    assert graphs.captured == FREE_CAPTURES  # then the copies stayed eager
    assert graphs.replays_total == FREE_CAPTURES

    for _ in range(REPLAYS_PER_CAPTURE):  # the captured layouts come back and replay
        for layout in range(1000, 1000 + FREE_CAPTURES):
            _copy(graphs, layout, target, sources)
    assert graphs.replays_total >= REPLAYS_PER_CAPTURE * graphs.captured
    for _ in range(3):
        _copy(graphs, 5000, target, sources)
    assert graphs.captured == FREE_CAPTURES + 1  # captures pay again


def test_after_the_graphs_are_dropped_captures_are_free_again(monkeypatch):
    """At MAX_GRAPHS every graph is dropped. The policy counts from there: the first captures after
    the drop are free. (Counted over all time, the replays the dropped graphs had earned were no
    longer growing, and new layouts waited for replays of graphs that were gone.)"""
    monkeypatch.setattr(step_graphs, "MAX_GRAPHS", 8)
    monkeypatch.setattr(step_graphs, "FREE_CAPTURES", 4)
    graphs, target, sources = _HostGraphs(_copy_all), torch.empty(4), {}
    for layout in range(9):  # a change, a first steady sighting, the capture, one replay: the 9th drops all
        for _ in range(4):
            _copy(graphs, layout, target, sources)
    assert graphs.captured == 9 and len(graphs._graphs) == 1
    for layout in range(100, 103):  # new layouts, each seen steady twice
        for _ in range(3):
            _copy(graphs, layout, target, sources)
    assert graphs.captured == 12


def test_a_failed_capture_leaves_copies_eager(monkeypatch):
    graphs, target, sources = StepGraphs(_copy_all), torch.empty(4), {}
    # On CPU the real capture fails (no CUDA stream): a warning, graphs off, every copy still lands.
    monkeypatch.setattr(step_graphs.warnings, "warn", lambda *a, **k: None)
    for _ in range(3):
        _copy(graphs, 7, target, sources)
    assert not graphs.enabled and graphs.captured == 0
