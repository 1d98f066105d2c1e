"""The paired GPU bench's interval for a ratio of medians (experiments/gpu/bench_gpu.py): pure
arithmetic, checked on series whose ratio is known; the host probe that runs before it, and the
core pinning built on the probe; the capture grid's row floor and the GPU serving bench's summary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.gpu.bench_gpu import median_ratio_interval, pooled_ratio


def test_series_in_a_fixed_ratio_give_exactly_that_ratio():
    b = [0.31, 0.25, 0.40, 0.28, 0.33]
    assert median_ratio_interval([2 * x for x in b], b) == pytest.approx((2.0, 2.0))


def test_the_interval_holds_the_true_ratio_and_widens_with_noise():
    rng = np.random.default_rng(1)
    base = rng.uniform(0.6, 0.7, 40)
    widths = []
    for noise in (0.01, 0.2):
        a = base * 1.05 * (1 + noise * rng.standard_normal(40))
        b = base * (1 + noise * rng.standard_normal(40))
        lo, hi = median_ratio_interval(list(a), list(b))
        assert lo < 1.05 < hi
        widths.append(hi - lo)
    assert widths[0] < 0.05 < widths[1]


def test_pooling_two_engines_of_each_kind_halves_one_slow_engine():
    rng = np.random.default_rng(2)
    base = rng.uniform(0.9, 1.1, 30)
    # capture 5% slower than plain, and the second plain engine a slow process (+10%)
    seconds = {"plain-graphs": list(base), "plain-graphs-b": list(base * 1.10),
               "ours-graphs": list(base * 1.05), "ours-same": list(base * 1.05)}
    ratio, (lo, hi) = pooled_ratio(seconds)
    assert ratio == pytest.approx(1.05 / 1.05)  # the slow plain engine lifts plain's mean to 1.05
    assert lo <= ratio <= hi
    seconds["plain-graphs-b"] = list(base)
    assert pooled_ratio(seconds)[0] == pytest.approx(1 / 1.05)


def test_engine_processes_count_the_cpu_time_of_the_processes_an_engine_started():
    import subprocess
    import sys
    import time

    from experiments.bench.processes import EngineProcesses

    processes = EngineProcesses()
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.2: pass"])
    idle = None
    try:
        time.sleep(0.05)
        assert processes.note("busy") == [busy.pid]
        idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.2)"])
        assert processes.note("idle") == [idle.pid]  # only what started since the last note
        before = {name: processes.cpu_seconds(name) for name in ("busy", "idle")}
        time.sleep(0.8)  # the busy child gets well over 0.2 s of it even on a loaded 2-core machine
        spent = {name: processes.cpu_seconds(name) - before[name] for name in before}
    finally:
        busy.wait()
        if idle is not None:
            idle.wait()
    assert spent["busy"] > 0.2 > spent["idle"]


def test_series_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="equally long"):
        median_ratio_interval([1.0, 2.0], [1.0])


def test_the_host_probe_times_every_core_it_may_run_on(tmp_path, monkeypatch):
    import os
    import sys

    from experiments.gpu import host_probe

    monkeypatch.setattr(sys, "argv", ["host_probe", "--out", str(tmp_path), "--reps", "2"])
    host_probe.main()
    result = json.loads((tmp_path / "host-probe.json").read_text())
    assert result["cores"] == sorted(os.sched_getaffinity(0))
    assert set(result["work_ms_median_per_core"]) == {str(c) for c in result["cores"]}
    assert 0 < result["work_ms_median_all"] <= result["work_ms_slowest_core"]
    assert 0.0 <= result["steal_fraction"] < 1.0


def test_cores_are_grouped_by_physical_core_whatever_their_ids():
    from experiments.gpu.host_probe import cpu_list, physical_cores

    assert cpu_list("0,8") == [0, 8] and cpu_list("2-3") == [2, 3] and cpu_list("5\n") == [5]
    smt_apart = {c: f"{c % 4},{c % 4 + 4}" for c in range(8)}  # siblings 0 and 4, 1 and 5, ...
    assert physical_cores(list(range(8)), smt_apart) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    smt_adjacent = {c: f"{c - c % 2}-{c - c % 2 + 1}" for c in range(8)}
    assert physical_cores(list(range(8)), smt_adjacent) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert physical_cores([3, 1], {}) == [[1], [3]]  # no topology known: one core each


def test_fastest_first_orders_every_physical_core_and_leaves_the_affinity_as_it_was():
    import os

    from experiments.gpu.bench_gpu import fastest_first
    from experiments.gpu.host_probe import physical_cores

    allowed = os.sched_getaffinity(0)
    units = physical_cores(sorted(allowed))
    ordered = fastest_first(units)
    assert sorted(ordered) == sorted(units)  # a reordering: no core lost or repeated
    assert os.sched_getaffinity(0) == allowed  # the probe pinned itself one core at a time, then let go


def test_an_unknown_pin_mode_is_refused_before_anything_is_pinned():
    import os

    from experiments.gpu.bench_gpu import CorePinner

    allowed = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="pin mode 'spread'"):
        CorePinner(2, "spread")
    assert os.sched_getaffinity(0) == allowed


def test_across_rounds_is_the_median_of_rounds_with_an_interval_around_it():
    from experiments.gpu.bench_gpu import across_rounds, round_ratio

    med, (lo, hi) = across_rounds([0.90, 0.97, 0.95, 0.96, 0.93])
    assert med == pytest.approx(0.95) and 0.90 <= lo <= med <= hi <= 0.97
    med, interval = across_rounds([0.96, 0.96, 0.96])
    assert med == pytest.approx(0.96) and interval == pytest.approx((0.96, 0.96))
    with pytest.raises(ValueError):
        across_rounds([0.9])
    # A round with two engines of each kind is pooled; one without takes its ratio of medians.
    single = {"seconds": {"plain-graphs": [1.0, 1.0], "ours-graphs": [1.1, 1.1]}, "ratio_of_medians": 1 / 1.1}
    assert round_ratio(single) == pytest.approx(1 / 1.1)
    pooled = {"seconds": {"plain-graphs": [1.0, 1.0], "plain-graphs-b": [1.2, 1.2], "ours-graphs": [1.1, 1.1],
                          "ours-same": [1.1, 1.1]}, "ratio_of_medians": 1 / 1.1}
    assert round_ratio(pooled) == pytest.approx(1.0)


def test_the_grid_floor_counts_each_prompt_once_and_every_generated_row_but_the_last():
    from experiments.bench.grid import floor_rows, layer_set

    # 2 prompts of 10 tokens, n=3, 5 tokens each: the last sampled token is never forwarded
    assert floor_rows(2, 10, 3, 5, "all") == 2 * 10 + 2 * 3 * 4
    assert floor_rows(2, 10, 3, 5, "generated") == 2 * 3 * 4
    assert layer_set(32, "1") == (16,) and layer_set(32, "3") == (0, 16, 32) and layer_set(32, "all") == tuple(range(33))


def test_the_serving_summary_pools_chunk_gaps_and_counts_failures_apart():
    from experiments.serving.bench_gpu import summarise

    ok = [{"ttft": 0.1 * (i + 1), "gaps": [0.01, 0.02, 0.03], "chunks": 4, "tokens": 4, "prompt_tokens": 100,
           "e2e": 1.0, "tpot": 0.02} for i in range(3)]
    s = summarise([*ok, {"error": "HTTP 500: boom"}], wall=2.0)
    assert (s["requests"], s["failed"], s["errors"]) == (4, 1, ["HTTP 500: boom"])
    assert s["output_tokens"] == 12 and s["output_tok_per_s"] == 6.0 and s["tokens_per_chunk"] == 1.0
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["ttft_p95_s"] == pytest.approx(0.3)
    assert s["itl_p50_s"] == 0.02 and s["itl_p95_s"] == 0.03
