"""Serving pieces that need no engine: the request field's checks, the body guard and the engine
gate on reserved keys, the rows budget per response, and the worker's fetch by tags."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from uhead_vllm.adapters import ScheduledStep, StepOutputs
from uhead_vllm.capture.protocol import CaptureSettings, RequestTag
from uhead_vllm.capture.recorder import RowRecorder
from uhead_vllm.serving.record import RequestRecord
from uhead_vllm.serving.spec import (BadUncertaintyRequest, ServerLimits, UncertaintySpec, check_row_budget,
                                     check_user_xargs, parse_uncertainty)

LIMITS = ServerLimits((0, 2, 4), 128, "h", 1 << 20)
WITH_POINTS = ServerLimits((0, 2, 4), 128, "h", 1 << 20, (("attn_in", 0), ("mlp_out", 1)))


def test_spec_defaults_and_errors():
    assert parse_uncertainty(None, LIMITS) is None and parse_uncertainty(False, LIMITS) is None
    spec = parse_uncertainty(True, LIMITS)
    assert spec.steps and spec.rows is None and spec.max_bytes == 1 << 20
    spec = parse_uncertainty({"rows": {"layers": [4, 0], "dtype": "bfloat16"}, "max_bytes": 1000}, LIMITS)
    assert spec.rows.layers == (4, 0) and spec.rows.bytes_per_value == 2
    for bad, needle in [([1], "must be true or an object"), ({"x": 1}, "unknown key"),
                        ({"rows": {"layers": []}}, "non-empty list"), ({"rows": {"layers": [3]}}, "not captured"),
                        ({"rows": {"layers": [0, 0]}}, "duplicates"), ({"rows": {"dtype": "int8"}}, "dtype"),
                        ({"rows": {"dtype": ["float32"]}}, "dtype"), ({"rows": {"dtype": {"a": 1}}}, "dtype"),
                        ({"steps": "yes"}, "boolean"), ({"max_bytes": -1}, "positive"),
                        ({"max_bytes": 1 << 30}, "server's limit"), ({"head": "g"}, "unknown head"),
                        ({"steps": False}, "asks for nothing")]:
        with pytest.raises(BadUncertaintyRequest, match=needle):
            parse_uncertainty(bad, LIMITS)
    no_head = ServerLimits((0,), 8, None, 100)
    with pytest.raises(BadUncertaintyRequest, match="no uncertainty head"):
        parse_uncertainty(True, no_head)
    assert parse_uncertainty({"rows": {}}, no_head).steps is False


def test_row_budget_and_reserved_xargs():
    spec = UncertaintySpec(rows=parse_uncertainty({"rows": {"layers": [0]}}, LIMITS).rows, max_bytes=128 * 4 * 10)
    check_row_budget(spec, 1, 10, 128)
    with pytest.raises(BadUncertaintyRequest, match="budget exceeded"):
        check_row_budget(spec, 2, 10, 128)
    with pytest.raises(BadUncertaintyRequest, match="needs max_tokens"):
        check_row_budget(spec, 1, None, 128)
    check_user_xargs({"other": 1})
    with pytest.raises(BadUncertaintyRequest, match="reserved"):
        check_user_xargs({"uhead_vllm": "x"})


def test_rows_with_points_defaults_aliases_errors_and_budget():
    def rows(value, limits=WITH_POINTS):
        return parse_uncertainty({"rows": value}, limits).rows

    assert (rows({}).layers, rows({}).points) == ((0, 2, 4), (("attn_in", 0), ("mlp_out", 1)))  # every column
    assert rows({"layers": [2]}).points == ()  # one key named: the other defaults to none
    spec = rows({"points": ["mlp_out.1", ["pre_attn", 0]]})
    assert spec.layers == () and spec.points == (("mlp_out", 1), ("attn_in", 0)) and spec.num_columns == 2
    assert rows({"layers": [4], "points": ["post_attn.0"]}, ServerLimits((4,), 8, None, 100, (("attn_out", 0),))
                ).points == (("attn_out", 0),)
    for bad, needle in [({"points": "mlp_out.1"}, "must be a list"), ({"points": ["mlp_out"]}, "point.layer"),
                        ({"points": ["mlp_out.3"]}, r"\['mlp_out.3'\] are not captured"),
                        ({"points": ["resid_post.1"]}, "resid_post"), ({"points": ["attn.1"]}, "unknown point"),
                        ({"points": ["mlp_out.1", ["mlp_out", 1]]}, "duplicates"),
                        ({"layers": [], "points": []}, "no column"), ({"layers": []}, "non-empty")]:
        with pytest.raises(BadUncertaintyRequest, match=needle):
            rows(bad)
    with pytest.raises(BadUncertaintyRequest, match="captured points: none"):
        rows({"points": ["mlp_out.1"]}, LIMITS)
    # the budget counts the point columns: 10 tokens of one column fit, of two they do not
    one_column = 10 * 128 * 4
    check_row_budget(UncertaintySpec(rows=rows({"layers": [0]}), max_bytes=one_column), 1, 10, 128)
    with pytest.raises(BadUncertaintyRequest, match="2 column"):
        check_row_budget(UncertaintySpec(rows=rows({"layers": [0], "points": ["mlp_out.1"]}), max_bytes=one_column),
                         1, 10, 128)


def test_serve_points_option_is_checked_before_vllm_starts(tiny_models, monkeypatch, capsys):
    """``serve --points`` reaches the engine's capture settings (canonical, aliases and ``:`` read);
    an unknown point, a layer the model lacks, or a compiled engine is refused before vLLM runs."""
    import json

    import uhead_vllm.adapters.server as server_adapter
    from uhead_vllm.cli import build_parser, main
    from uhead_vllm.serving.launch import vllm_argv

    model = str(tiny_models["llama"])
    args, rest = build_parser().parse_known_args(["serve", "--model", model, "--head", "none",
                                                  "--points", "pre_attn.1", "mlp_out:3,mlp_in.0"])
    argv = vllm_argv(args, rest)
    config = json.loads(argv[argv.index("--additional-config") + 1])
    assert config["uhead_vllm"]["points"] == [["attn_in", 1], ["mlp_out", 3], ["mlp_in", 0]]
    monkeypatch.setattr(server_adapter, "run_api_server", lambda vargs: pytest.fail("vLLM must not start"))
    for extra, needle in [(["--points", "mlp_out.4"], "4 decoder layers"), (["--points", "resid_post.1"], "resid_post"),
                          (["--points", "mlp_out.1", "--no-enforce-eager"], "serve --points needs an eager engine"),
                          (["--steering", "--no-enforce-eager"], "serve --steering needs an eager engine")]:
        assert main(["serve", "--model", model, "--head", "none", *extra]) == 2
        assert needle in capsys.readouterr().err


def test_stop_above_and_keep_below_are_p_wrong_thresholds_that_need_steps():
    spec = parse_uncertainty({"stop_above": 0.8, "keep_below": 1}, LIMITS)
    assert (spec.stop_above, spec.keep_below) == (0.8, 1.0) and isinstance(spec.keep_below, float)
    assert parse_uncertainty(True, LIMITS).stop_above is None and parse_uncertainty(True, LIMITS).keep_below is None
    for key in ("stop_above", "keep_below"):
        for bad in (0, 0.0, -0.1, 1.5, float("nan"), float("inf"), "0.5", True, [0.5], {"p": 0.5}):
            with pytest.raises(BadUncertaintyRequest, match=f"'uncertainty.{key}' must be a number in \\(0, 1\\]"):
                parse_uncertainty({key: bad}, LIMITS)
        with pytest.raises(BadUncertaintyRequest, match="needs 'steps'"):
            parse_uncertainty({key: 0.5, "steps": False, "rows": {"layers": [0]}}, LIMITS)
    assert RequestRecord("k", spec, 0).watches_running
    assert not RequestRecord("k", parse_uncertainty({"keep_below": 0.5}, LIMITS), 0).watches_running


def test_plugin_capture_settings_are_checked_like_serve_flags(tiny_models):
    """``additional_config["uhead_vllm"]`` in the plugin form: points as strings or pairs (aliases
    and ``:`` read), the head's layers by default; unknown keys, bad points and hooks on a compiled
    engine are refused before vLLM builds anything."""
    from types import SimpleNamespace

    from uhead_vllm.errors import InputError
    from uhead_vllm.serving.plugin import add_capture, plugin_capture_settings

    model = str(tiny_models["llama"])
    got = plugin_capture_settings(model, "none", {"layers": [0, 4], "points": ["pre_attn.1", ["mlp_out", 3], "mlp_in:0"],
                                                  "steering": True, "max_bytes": 1 << 20})
    assert got == CaptureSettings((0, 4), "bfloat16", 1 << 20, (("attn_in", 1), ("mlp_out", 3), ("mlp_in", 0)), True)
    assert plugin_capture_settings(model, "none", None).layers == (0, 2, 4)  # --head none: 0, middle, last
    for given, needle in [({"layerz": [0]}, "keys among"), ({"points": ["mlp_out.4"]}, "4 decoder layers"),
                          ({"layers": [0], "dtype": "int8"}, "dtype"), ([0, 1], "must be an object")]:
        with pytest.raises(InputError, match=needle):
            plugin_capture_settings(model, "none", given)
    args = SimpleNamespace(model=model, worker_extension_cls=None, enforce_eager=True,
                           additional_config={"uhead_vllm": {"layers": [2], "points": ["mlp_out.1"]},
                                              "uhead_vllm_serve": {"head": "none"}})
    add_capture(args)
    assert args.worker_extension_cls.endswith("UheadCaptureExtension")
    assert args.additional_config["uhead_vllm"]["points"] == [["mlp_out", 1]]
    with pytest.raises(InputError, match="--enforce-eager"):
        add_capture(SimpleNamespace(**{**vars(args), "enforce_eager": False}))


def _step(recorder: RowRecorder, reqs: dict[str, int], new: dict[str, dict | None]) -> None:
    recorder.on_schedule(ScheduledStep(new_requests=list(new.items()), finished_req_ids=set(),
                                       num_scheduled_tokens=reqs))
    qsl = np.concatenate([[0], np.cumsum(list(reqs.values()))])
    total = int(qsl[-1])
    aux = [torch.arange(total * 4, dtype=torch.float32).view(total, 4) + 1000 * k for k in range(2)]
    recorder.on_forward(StepOutputs(req_ids=list(reqs), query_start_loc=qsl, aux=aux,
                                    positions=torch.arange(total), input_ids=torch.arange(total)))


def test_take_tags_takes_only_those_rows_and_forget_stops_recording():
    rec = RowRecorder(CaptureSettings((0, 2)), (0, 2), 4)
    _step(rec, {"a": 3, "b": 2, "c": 1}, {"a": RequestTag(1, 0).to_extra_args(),
                                          "b": RequestTag(2, 0).to_extra_args(), "c": None})
    _step(rec, {"a": 1, "b": 1}, {})
    one = rec.take_tags([1])
    assert one.num_rows == 4 and set(one.tags.tolist()) == {1}
    assert one.hidden.shape == (4, 2, 4)
    assert rec.bytes_held == 3 * 2 * 4 * 4  # tag 2's rows stay
    rec.take_tags([2], forget=True)
    _step(rec, {"a": 1, "b": 1}, {})
    rest = rec.take_tags([1, 2])
    assert rest.tags.tolist() == [1] and rec.bytes_held == 0


def test_record_keeps_rows_per_sequence_and_only_its_own():
    from uhead_vllm.capture.protocol import CapturedRows

    r = RequestRecord("k", UncertaintySpec(), 0)
    _, a = r.new_prompt(2, False)
    _, b = r.new_prompt(2, False)
    other = a ^ b ^ 1  # another request's tag, in the same take
    z = torch.tensor
    r.add_rows(CapturedRows((0,), torch.arange(6.0).view(6, 1, 1), z([a, b, a, a, other, other]),
                            z([0, 0, 1, 0, 0, 1]), z([0, 0, 0, 1, 0, 0]), z([9] * 6), z([0, 6])))
    pos, ids, hidden = r.captured(a, 0)
    assert pos.tolist() == [0, 1] and hidden.flatten().tolist() == [0.0, 3.0]
    assert r.captured(a, 1)[0].tolist() == [0] and r.captured(b, 1) is None
    assert r.captured(other, 0) is None and r.bytes_held() == 4 * 4


def test_takes_while_one_runs_share_the_next_rpc_and_each_record_keeps_its_rows():
    """Three requests fetch at once from a real recorder: the first take runs alone, the two that
    asked while it ran share the next one, and each record ends with exactly its own rows."""
    import asyncio

    from uhead_vllm.serving.takes import TakeQueue

    rec = RowRecorder(CaptureSettings((0, 2)), (0, 2), 4)
    records = [RequestRecord(str(k), UncertaintySpec(), 0) for k in range(3)]
    tags = [r.new_prompt(1, False)[1] for r in records]
    _step(rec, {"a": 3, "b": 2, "c": 1}, {x: RequestTag(t, 0).to_extra_args() for x, t in zip("abc", tags)})
    calls: list[list[int]] = []

    async def take(wanted: list[int], forget: bool, expect_rows: int):
        calls.append(wanted)
        await asyncio.sleep(0.01)  # an RPC's round trip: the others ask meanwhile
        return rec.take_tags(wanted, forget)

    async def main() -> None:
        queue = TakeQueue(take, forget=False)
        first = asyncio.ensure_future(queue.take([tags[0]], 3, records[0].add_rows))
        await asyncio.sleep(0)
        await asyncio.gather(first, *(queue.take([t], 2, r.add_rows) for t, r in zip(tags[1:], records[1:])))
        assert (queue.rounds, queue.callers) == (2, 3)

    asyncio.run(main())
    assert calls == [[tags[0]], sorted(tags[1:])]
    assert [r.captured(t, 0)[0].numel() for r, t in zip(records, tags)] == [3, 2, 1]
    assert all(r.captured(t, 0) is None for r in records for t in tags if t not in r.tags)
    assert rec.bytes_held == 0


def test_body_guard_refuses_reserved_keys_anywhere_and_fields_a_route_cannot_serve():
    from uhead_vllm.serving.guard import refusal

    tag = {"uhead_vllm": {"tag": 1, "sample": 0}}
    for path in ["/v1/responses", "/v1/messages", "/v1/chat/completions/batch", "/v1/completions",
                 "/v1/chat/completions", "/anything"]:
        assert "reserved" in refusal(path, {"vllm_xargs": tag})
        assert "reserved" in refusal(path, {"vllm_xargs": {"UHEAD_VLLM_serve": "k"}})
        assert "reserved" in refusal(path, {"sampling_params": {"extra_args": tag}})  # nested (tokens-in route)
        assert "reserved" in refusal(path, {"vllm_xargs": '{"uhead_vllm": 1}'})  # a form field's JSON string
        assert refusal(path, {"vllm_xargs": {"other": 1}, "messages": [{"content": "uhead_vllm"}]}) is None
    assert refusal("/v1/chat/completions", {"vllm_xargs": {"uhead_steer": []}}) is None  # checked by the handler
    assert "served on" in refusal("/v1/messages", {"vllm_xargs": {"uhead_steer": "x"}})
    assert "'uncertainty' is served on" in refusal("/v1/responses", {"uncertainty": True})
    assert "'steer' is served on" in refusal("/v1/chat/completions/batch", {"steer": []})
    assert refusal("/v1/responses", {"uncertainty": False}) is None
    deep = {"vllm_xargs": tag}
    for _ in range(5000):
        deep = {"a": [deep]}
    assert "reserved" in refusal("/v1/responses", deep)  # no recursion limit


def test_engine_gate_lets_through_only_what_the_server_minted():
    from vllm import SamplingParams

    from uhead_vllm.adapters.server import MINTED_KEY, _checked, minted
    from uhead_vllm.errors import ReservedKeysError
    from uhead_vllm.serving.spec import reserved_keys

    forged = SamplingParams(max_tokens=2, extra_args={"uhead_vllm": {"tag": 1, "sample": 0}})
    with pytest.raises(ReservedKeysError, match="reserved"):
        _checked(forged, reserved_keys)
    forged.extra_args[MINTED_KEY] = "Minted"  # a JSON value is never the mark
    with pytest.raises(ReservedKeysError):
        _checked(forged, reserved_keys)
    ours = minted(SamplingParams(max_tokens=2, extra_args={"uhead_steer": [], "x": 1}))
    passed = _checked(ours, reserved_keys)
    assert passed.extra_args == {"uhead_steer": [], "x": 1} and MINTED_KEY in ours.extra_args  # a copy left the shared one
    plain = SamplingParams(max_tokens=2, extra_args={"x": 1})
    assert _checked(plain, reserved_keys) is plain


def test_rows_budget_counts_prompt_rows_per_response_before_generating():
    spec = parse_uncertainty({"rows": {"layers": [0, 2]}, "max_bytes": 10_000}, LIMITS)
    record = RequestRecord("k", spec, 0)
    record.row_bytes = 2 * 128 * 4
    record.new_prompt(1, True, 5, 4)  # 8 rows x 1024 bytes
    with pytest.raises(BadUncertaintyRequest, match=r"can take 18432 bytes .*2 sequence\(s\) x \(2 prompt \+ 4"):
        record.new_prompt(2, True, 2, 4)  # the second prompt's rows push the response over
    assert len(record.prompts) == 1 and record.rows_bound == 8 * 1024


def test_steering_that_overflows_is_refused_and_scores_stay_json():
    import json

    import torch

    from uhead_vllm.serving.handlers import finite_scores
    from uhead_vllm.serving.spec import MAX_STEER_NORM, parse_steer

    def steer(vector, scale=1.0, dtype=torch.float32):
        return parse_steer([{"point": "mlp_out", "layer": 1, "vector": vector, "scale": scale}], None, True, 4, 2, dtype)

    assert steer([3.0, 4.0], MAX_STEER_NORM / 5).terms[0].scale == MAX_STEER_NORM / 5
    for vector, scale, dtype in [([1e39, 0.0], 1.0, torch.float32), ([0.1, 0.1], 1e30, torch.float32),
                                 ([1e200, 1e200], 0.0, torch.float32), ([300.0, 0.0], 1.0, torch.float16)]:
        with pytest.raises(BadUncertaintyRequest, match="norm"):
            steer(vector, scale, dtype)
    with pytest.raises(BadUncertaintyRequest, match="steer"):
        steer([10 ** 400, 0])
    two = [{"point": "mlp_out", "layer": 1, "vector": [6e5, 0.0]}] * 2  # each fits, together they do not
    with pytest.raises(BadUncertaintyRequest, match="mlp_out.1"):
        parse_steer(two, None, True, 4, 2, torch.float32)
    obj = finite_scores({"answer_p_wrong": float("nan"), "steps": [{"p_wrong": float("inf"), "features": [1.0, float("nan")]}]})
    assert json.loads(json.dumps(obj, allow_nan=False)) == {"answer_p_wrong": None,
                                                            "steps": [{"p_wrong": None, "features": [1.0, None]}]}


class _DeviceProgress:
    """Stands in for a CUDA event of a step still running on the device (query: done yet?)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        assert self.done, "a tag take waited for a forward that still runs"


def test_tag_takes_never_wait_for_a_running_forward_and_a_forget_drops_its_rows():
    """Under async scheduling the engine core answers a take while the next step still runs: its
    rows stay held (the caller has not seen its tokens), the take does not wait, the next take
    brings them; a forget drops a tag's rows of that step at once."""
    from uhead_vllm.capture.sinks.held import _Running

    rec = RowRecorder(CaptureSettings((0, 2)), (0, 2), 4)
    tags = {"a": RequestTag(1, 0).to_extra_args(), "b": RequestTag(2, 0).to_extra_args()}
    _step(rec, {"a": 3, "b": 2}, tags)
    _step(rec, {"a": 1, "b": 1}, {})
    held = rec.held
    finished, running = _DeviceProgress(), _DeviceProgress()
    finished.done = True
    seg = held.segments[0]
    held.running.extend([_Running(seg, 0, finished, finished), _Running(seg, 5, running, running)])
    seg.hidden[5:7].neg_().sub_(1)  # the running step's rows: negative
    got = rec.take_tags([1, 2])
    assert got.num_rows == 5 and bool((got.hidden >= 0).all()) and finished.waited == 1 and running.waited == 0
    assert got.tags.tolist() == [1, 1, 1, 2, 2] and got.positions.tolist() == [0, 1, 2, 3, 4]
    assert got.chunk_offsets.tolist() == [0, 3, 5] and rec.bytes_held == 2 * 2 * 4 * 4
    rec.take_tags([2], forget=True)  # tag 2's row of the running step goes at once
    assert running.waited == 0 and rec.bytes_held == 1 * 2 * 4 * 4
    running.done = True
    later = rec.take_tags([1, 2])
    assert later.tags.tolist() == [1] and bool((later.hidden < 0).all()) and rec.bytes_held == 0
    assert not held.holds_rows()


def test_a_tag_take_returns_its_chunks_in_recording_order_and_leaves_the_rest_whole():
    """Three steps of three requests; taking two tags, then the third, then a full take: each row
    once, in the order recorded, and the counters of what is held follow."""
    rec = RowRecorder(CaptureSettings((0, 2)), (0, 2), 4)
    tags = {x: RequestTag(t, 0).to_extra_args() for x, t in zip("abc", (7, 8, 9))}
    _step(rec, {"a": 2, "b": 1, "c": 3}, tags)
    _step(rec, {"a": 1, "b": 1, "c": 1}, {})
    _step(rec, {"a": 1, "c": 1}, {})
    everything = torch.cat([torch.arange(6 * 4, dtype=torch.float32).view(6, 4)[:, None] + 1000 * k
                            for k in range(2)], 1)  # what _step's first forward produced
    two = rec.take_tags([9, 7])
    assert two.tags.tolist() == [7, 7, 9, 9, 9, 7, 9, 7, 9]
    assert torch.equal(two.hidden[:5], everything[[0, 1, 3, 4, 5]])
    assert two.chunk_offsets.tolist() == [0, 2, 5, 6, 7, 8, 9]  # a chunk per request and step
    assert rec.bytes_held == 1 * 2 * 4 * 4 * 2  # b's rows of steps 1 and 2
    rest = rec.take()
    assert rest.tags.tolist() == [8, 8] and rest.positions.tolist() == [2, 1] and rec.bytes_held == 0


def test_held_rows_span_segments_and_a_full_segment_goes_once_taken(monkeypatch):
    """Steps fill segments of a few rows; a take reads across them in order, and a segment none of
    whose rows is left is freed (its memory with it)."""
    from uhead_vllm.capture.sinks import held as held_module

    monkeypatch.setattr(held_module, "SEGMENT_ROWS", 4)
    rec = RowRecorder(CaptureSettings((0, 2)), (0, 2), 4)
    tags = {"a": RequestTag(1, 0).to_extra_args(), "b": RequestTag(2, 0).to_extra_args()}
    _step(rec, {"a": 1, "b": 1}, tags)
    for _ in range(4):
        _step(rec, {"a": 1, "b": 1}, {})
    assert len(rec.held.segments) == 3  # 10 rows, 4 a segment
    a = rec.take_tags([1])
    assert a.positions.tolist() == [0, 0, 0, 0, 0] and len(rec.held.segments) == 3
    b = rec.take_tags([2])
    assert b.positions.tolist() == [1, 1, 1, 1, 1] and b.chunk_offsets.tolist() == [0, 1, 2, 3, 4, 5]
    assert len(rec.held.segments) == 1 and rec.bytes_held == 0  # the last one stays, emptied for reuse
    _step(rec, {"a": 2}, {})
    assert rec.held.segments[0].used == 2 and rec.take_tags([1]).num_rows == 2
