"""The row placer on its own (no engine): rows land at first + position, in submission order, only
after their copy is ready, and failures surface at drain instead of vanishing."""

from __future__ import annotations

import dataclasses
import gc
import os
import threading

import numpy as np
import pytest
import torch

from uhead_vllm.capture.placer import ChunkSlots, Placer, place_step
from uhead_vllm.capture.destination import RowDestination
from uhead_vllm.envs import STEP_BATCH_ENV


class Gate:
    """Stands in for a CUDA event: ``synchronize`` blocks until the test opens it."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def synchronize(self) -> None:
        assert self.opened.wait(10), "placer waited for a copy that never became ready"


def meta(positions, tokens=None):
    """A step's metadata as the recorder hands it to the placer: positions, input tokens (by
    default 100 + position)."""
    positions = torch.as_tensor(positions, dtype=torch.int64)
    tokens = positions + 100 if tokens is None else torch.as_tensor(tokens, dtype=torch.int64)
    return torch.stack([positions, tokens])


def slots(first, capacity, lens, group_row=None):
    """Per-chunk slot facts as the recorder hands them to the placer."""
    a = lambda x: None if x is None else np.asarray(x, dtype=np.int64)  # noqa: E731
    return ChunkSlots(a(first), a(capacity), a(lens), a(group_row))


def test_rows_land_at_their_slots_after_the_copy_is_ready_and_last_write_wins():
    dest = RowDestination(torch.full((10, 1, 2), -1.0), {7: (0, 4), 8: (4, 6)})
    placer = Placer()
    gate = Gate()
    prefill = torch.arange(10, dtype=torch.float32).view(5, 1, 2)
    placer.submit(gate, dest, prefill, meta([0, 1, 2, 0, 1]), slots([0, 4], [4, 6], [3, 2]))
    assert bool((dest.buffer == -1).all())  # not before the copy is ready
    redo = torch.full((1, 1, 2), 99.0)  # position 1 of tag 7 forwarded again (a rejected draft)
    placer.submit(gate, dest, redo, meta([1]), slots([0], [4], [1]))
    gate.opened.set()
    error, seconds = placer.drain()
    assert error is None and seconds > 0
    assert torch.equal(dest.buffer[0], prefill[0]) and torch.equal(dest.buffer[1], redo[0])
    assert torch.equal(dest.buffer[2], prefill[2])
    assert torch.equal(dest.buffer[4:6], prefill[3:5]) and bool((dest.buffer[6:] == -1).all())
    # each place's token mark is the input token of the row written there; -1 where none was
    assert dest.tokens.tolist() == [100, 101, 102, -1, 100, 101, -1, -1, -1, -1]


def test_placing_at_drain_holds_every_step_until_the_drain_and_keeps_their_order():
    """The measuring mode (``UHEAD_PLACE_AT_DRAIN=1``): no thread beside the engine; a step whose
    rows are already on the host queues behind held ones instead of overtaking them."""
    dest = RowDestination(torch.full((6, 1, 2), -1.0), {7: (0, 6)})
    placer = Placer(at_drain=True)
    gate = Gate()
    gate.opened.set()  # copies done long ago: still nothing is written before the drain
    first = torch.full((2, 1, 2), 1.0)
    placer.submit(gate, dest, first, meta([0, 1]), slots([0], [6], [2]))
    again = torch.full((1, 1, 2), 2.0)  # position 1 forwarded again, its rows already on the host
    placer.submit(None, dest, again, meta([1]), slots([0], [6], [1]))
    assert bool((dest.buffer == -1).all()) and placer._thread is None
    error, _ = placer.drain()
    assert error is None
    assert dest.buffer[:, 0, 0].tolist() == [1.0, 2.0, -1.0, -1.0, -1.0, -1.0]  # the later step wins
    assert Placer().at_drain is (os.environ.get("UHEAD_PLACE_AT_DRAIN") == "1")


def test_in_one_placed_batch_the_last_row_for_a_place_wins_and_rows_of_unknown_tags_never_count():
    dest = RowDestination(torch.full((6, 1, 1), -1.0), {7: (0, 3), 8: (3, 3)})
    rows = torch.arange(6, dtype=torch.float32).view(6, 1, 1)
    # steps joined: tag 7 at 0, 1; an unknown tag (first -1) at 2 -> index 1; tag 7 at 1 again; tag 8 at 0, 0
    place_step(dest, rows, meta([0, 1, 2, 1, 0, 0]), slots([0, -1, 0, 3], [3, 0, 3, 3], [2, 1, 1, 2]))
    assert dest.buffer.flatten().tolist() == [0.0, 3.0, -1.0, 5.0, -1.0, -1.0]
    assert dest.tokens.tolist() == [100, 101, -1, 100, -1, -1]  # the marks of the rows that won


def test_rows_past_a_slot_or_of_unknown_tags_are_not_written():
    dest = RowDestination(torch.zeros(4, 1, 1), {1: (0, 2), 2: (2, 2)})
    placer = Placer()
    rows = torch.ones(4, 1, 1)
    # tag 1 at positions 1, 2 (2 is past its capacity), an unknown tag (first = -1), tag 2 at 0
    placer.submit(None, dest, rows, meta([1, 2, 0, 0]), slots([0, -1, 2], [2, 0, 2], [2, 1, 1]))
    assert placer.drain()[0] is None
    assert dest.buffer.flatten().tolist() == [0.0, 1.0, 1.0, 0.0]


def test_a_failed_placement_is_reported_at_drain_and_later_steps_still_run():
    dest = RowDestination(torch.zeros(2, 1, 3), {1: (0, 2)})
    placer = Placer()
    gate = Gate()
    gate.opened.set()
    placer.submit(gate, dest, torch.ones(1, 1, 5), meta([0]), slots([0], [2], [1]))  # wrong width
    placer.submit(gate, dest, torch.ones(1, 1, 3), meta([1]), slots([0], [2], [1]))
    error, _ = placer.drain()
    assert error is not None and "placing captured rows failed" in error
    assert dest.buffer[1].flatten().tolist() == [1.0, 1.0, 1.0]
    assert placer.drain()[0] is None  # reported once


def mirrors(dest, tag):
    """What the destination's group tables say ``tag`` shares: {first row of another slot: limit}
    (its groups outer to inner, each member range's limit overwritten by the deeper groups)."""
    k = dest.group_row[tag]
    shared = {}
    for g, limit in zip(dest.chain[k], dest.chain_limit[k]):
        if g >= 0:
            lo, hi = dest.group_span[g]
            shared.update({int(dest.member_first[m]): int(limit) for m in range(lo, hi) if m != dest.member_index[k]})
    return shared


def test_prefix_groups_become_per_pair_limits_the_deepest_shared_group_decides():
    # tags 1-3 sample one 5-token prompt; tag 4's prompt shares its first 2 tokens (a block); 5 is alone
    dest = RowDestination(torch.zeros(30, 1, 1), {t: (5 * (t - 1), 5) for t in range(1, 6)},
                          [(5, (1, 2, 3)), (2, (1, 2, 3, 4))])
    assert mirrors(dest, 1) == {5: 5, 10: 5, 15: 2} and mirrors(dest, 4) == {0: 2, 5: 2, 10: 2}
    assert 5 not in dest.group_row and dest.chain.shape == (5, 2) and dest.member_first.size == 4
    # the deepest group's limit per member; the last row: no group
    assert [int(dest.reach[dest.group_row[t]]) for t in (1, 2, 3, 4)] == [5, 5, 5, 2] and dest.reach[-1] == 0


def test_prompt_rows_also_reach_the_slots_sharing_them_below_the_limit_only():
    dest = RowDestination(torch.zeros(25, 1, 1), {1: (0, 5), 2: (5, 5), 3: (10, 5), 4: (15, 5), 5: (20, 5)},
                          [(3, (1, 2, 3)), (2, (1, 2, 3, 4))])
    placer = Placer()
    # tag 1 forwards its whole prompt (0-2) and one generated row (3); tag 2 only its last prompt
    # row (2, the rest came from the prefix cache) and row 3; tag 4 its own third token (2) and
    # row 3 (positions 0-1 came from tag 1's blocks); tag 5 (no group) rows 0-1
    rows = torch.tensor([10.0, 11, 12, 13, 22, 23, 42, 43, 50, 51]).view(10, 1, 1)
    group_rows = [dest.group_row[1], dest.group_row[2], dest.group_row[4], -1]
    placer.submit(None, dest, rows, meta([0, 1, 2, 3, 2, 3, 2, 3, 0, 1]),
                  slots([0, 5, 15, 20], [5, 5, 5, 5], [4, 2, 2, 2], group_rows))
    assert placer.drain()[0] is None
    b = dest.buffer.flatten().tolist()
    # Position 2 of the prompt was forwarded by tags 1 and 2 (the same computation): any member's
    # slot may end with either row. Generated rows (position 3) stay in their own slot.
    for first, generated in ((0, 13), (5, 23), (10, 0)):
        assert b[first : first + 2] == [10, 11] and b[first + 2] in (12, 22)
        assert b[first + 3 : first + 5] == [generated, 0]
    assert b[15:20] == [10, 11, 42, 43, 0]  # the shared block from tag 1, its own third token
    assert b[20:25] == [50, 51, 0, 0, 0]  # no group: nothing mirrored
    # Marks: a member's own rows carry their token, rows from another member -2 - token. Tag 2's
    # own row at position 2 stays its own (a shared write never goes over it); tag 3 forwarded nothing.
    t = dest.tokens.tolist()
    assert t[0:5] == [100, 101, 102, 103, -1] and t[5:10] == [-100 - 2, -101 - 2, 102, 103, -1]
    assert t[10:15] == [-102, -103, -104, -1, -1]
    assert t[15:20] == [-102, -103, 102, 103, -1] and t[20:25] == [100, 101, -1, -1, -1]


def test_one_group_of_thousands_of_requests_stays_small_and_every_member_gets_the_shared_rows():
    # 2000 prompts x 2 samples sharing a 3-token block (a system prompt), each prompt 4 tokens
    n = 4000
    groups = [(4, (2 * i, 2 * i + 1)) for i in range(n // 2)] + [(3, tuple(range(n)))]
    dest = RowDestination(torch.zeros(5 * n, 1, 1), {t: (5 * t, 5) for t in range(n)}, groups)
    assert dest.chain.shape == (n + 1, 2) and dest.member_first.shape == (n,)  # tags x depth, not tags^2
    # tag 0 forwards the whole prompt; tag 1 (its sibling) and every other tag only position 3,
    # the same row for two samples of one prompt (one computation)
    own = [10.0 + t // 2 for t in range(n)]
    rows = torch.tensor([1.0, 2, 3] + own).view(-1, 1, 1)
    positions = torch.tensor([0, 1, 2, 3] + [3] * (n - 1))
    place = Placer()
    place.submit(None, dest, rows, meta(positions), slots([5 * t for t in range(n)], [5] * n, [4] + [1] * (n - 1),
                                                     [dest.group_row[t] for t in range(n)]))
    assert place.drain()[0] is None
    b = dest.buffer.view(n, 5)
    assert bool((b[:, :3] == torch.tensor([1.0, 2, 3])).all())  # the shared block reached every slot
    assert b[:, 3].tolist() == own and bool((b[:, 4] == 0).all())  # each prompt's own row, nothing past it


def test_when_members_forward_one_shared_prefix_together_each_other_place_gets_the_last_of_their_rows():
    """A first prefill: several members of nested groups forward the same prompt positions in one
    step. The placer fans out only the last row per group and position; every place must still end
    as a row-by-row reference says (rows in step order, each onto every other member of the largest
    group whose limit is above its position, never over a member's own row; the last write wins)."""
    tags, size = list(range(8)), 6
    groups = [(2, tuple(tags)), (5, (0, 1, 2, 3)), (5, (4, 5, 6, 7))]
    dest = RowDestination(torch.zeros(size * len(tags), 1, 1), {t: (size * t, size) for t in tags}, groups)
    forwards = {0: range(5), 4: range(5), 1: range(5), 5: range(2, 5), 6: range(5), 2: [4], 7: [4]}  # in step order
    order = [(t, p) for t in forwards for p in forwards[t]]
    rows = torch.arange(1.0, len(order) + 1).view(-1, 1, 1)  # each row its own value: the winner shows
    placer = Placer()
    placer.submit(None, dest, rows, meta([p for _, p in order]),
                  slots([size * t for t in forwards], [size] * len(forwards), [len(f) for f in forwards.values()],
                        [dest.group_row[t] for t in forwards]))
    assert placer.drain()[0] is None
    expected = torch.zeros(size * len(tags))
    own = {(t, p) for t, p in order}
    for value, (t, p) in enumerate(order, start=1):
        expected[size * t + p] = value
    for value, (t, p) in enumerate(order, start=1):
        members = next(g for limit, g in groups if t in g and limit > p) if p < 5 else ()  # the largest first
        for m in members:
            if m != t and (m, p) not in own:
                expected[size * m + p] = value
    assert torch.equal(dest.buffer.flatten(), expected)
    # tag 3 forwarded nothing: its first two rows came from the outer group's last forwarder (tag 6),
    # the next two from its own group's (tag 1); tag 5's first two from tag 6 as well
    assert dest.buffer.flatten()[size * 3 : size * 3 + 4].tolist() == [order.index((6, 0)) + 1, order.index((6, 1)) + 1,
                                                                      order.index((1, 2)) + 1, order.index((1, 3)) + 1]


def test_prefix_groups_must_fit_their_members_slots_and_nest():
    with pytest.raises(ValueError, match="at least 4 rows"):
        RowDestination(torch.zeros(6, 1, 1), {1: (0, 3), 2: (3, 3)}, [(4, (1, 2))])
    with pytest.raises(ValueError, match="nested or disjoint"):
        RowDestination(torch.zeros(9, 1, 1), {1: (0, 3), 2: (3, 3), 3: (6, 3)}, [(1, (1, 2)), (2, (2, 3))])
    with pytest.raises(ValueError, match="nested or disjoint"):  # an inner group shorter than its outer one
        RowDestination(torch.zeros(9, 1, 1), {1: (0, 3), 2: (3, 3), 3: (6, 3)}, [(3, (1, 2, 3)), (2, (1, 2))])
    with pytest.raises(ValueError, match="nested or disjoint"):  # the same group twice
        RowDestination(torch.zeros(6, 1, 1), {1: (0, 3), 2: (3, 3)}, [(2, (1, 2)), (2, (2, 1))])


def test_prefix_groups_of_a_call():
    from uhead_vllm.generation.prefix_groups import prefix_groups

    head = [7, 7, 7, 7]  # one 4-token block every prompt starts with
    groups = prefix_groups([(b"", head + [1, 2], [10, 11]), (b"", head + [1, 3], [12]),
                            (b"", head + [5, 5, 5, 5, 9], [13]), (b"", head + [1, 2], [14]),
                            (b"salt", head + [1, 2], [15, 16])], block_size=4)
    # identical prompts (tags 10, 11, 14) over the whole prompt; the shared block over all
    # unsalted prompts; a steered (salted) prompt shares nothing with the others
    assert sorted(groups) == [(4, (10, 11, 14, 12, 13)), (6, (10, 11, 14)), (6, (15, 16))]


def test_destination_refuses_slots_outside_its_buffer():
    with pytest.raises(ValueError, match="buffer has 3"):
        RowDestination(torch.zeros(3, 1, 1), {1: (0, 2), 2: (2, 2)})


def _shared(files, shape, slots, groups=()):
    """What AuxClient.place_into does: a file from ``files``, its spec, and the engine side's view."""
    from uhead_vllm.capture.protocol import SharedDestination
    from uhead_vllm.capture.row_files import destination_nbytes, destination_on

    row_file, flat = files.take(destination_nbytes(shape, "bfloat16"))
    spec = SharedDestination(row_file.path, shape, "bfloat16", slots, row_file.file_id, list(groups),
                             row_file.key, row_file.nbytes, tuple(files.keys()))
    return row_file, spec, destination_on(spec, flat)


def test_shared_destination_maps_the_engine_sides_file_and_refuses_any_other(tmp_path):
    from uhead_vllm.capture.protocol import SharedDestination
    from uhead_vllm.capture.row_files import open_destination
    from uhead_vllm.generation.shared_rows import SharedRowFiles

    files = SharedRowFiles()
    row_file, spec, mine = _shared(files, (6, 2, 3), {4: (0, 3), 5: (3, 3)}, [(2, (4, 5))])
    theirs = open_destination(SharedDestination.from_json(spec.to_json()))  # what a worker process does
    theirs.buffer[2] = 7.0
    assert bool((mine.buffer[2] == 7.0).all()) and theirs.slots == {4: (0, 3), 5: (3, 3)}
    assert theirs.groups == [(2, (4, 5))] and mirrors(theirs, 5) == {0: 2}
    other = tmp_path / "same-name-elsewhere"
    other.write_bytes(b"\0" * 72)
    moved = dataclasses.replace(spec, path=str(other))
    with pytest.raises(FileNotFoundError, match="not the engine side's"):
        open_destination(moved)
    files.unname(row_file)
    assert not os.path.exists(spec.path)
    with pytest.raises(FileNotFoundError, match="not visible"):
        open_destination(SharedDestination.from_json(spec.to_json()))


def test_shared_row_files_are_written_again_only_once_nobody_holds_their_rows():
    from uhead_vllm.capture.protocol import SharedDestination
    from uhead_vllm.capture.row_files import destination_nbytes, open_destination
    from uhead_vllm.generation.shared_rows import SharedRowFiles

    files = SharedRowFiles(keep_idle=1)
    mapped: dict = {}  # the worker's mappings, kept across calls
    first, spec, mine = _shared(files, (6, 2, 3), {1: (0, 6)})
    theirs = open_destination(SharedDestination.from_json(spec.to_json()), mapped)
    files.unname(first)  # the worker mapped it: from now on it finds the file by key only
    theirs.buffer.fill_(1.0)
    held = mine.buffer[1:3]  # a result's view keeps the whole file in use
    del mine, theirs
    gc.collect()
    second, spec2, mine2 = _shared(files, (4, 2, 3), {2: (0, 4)})
    assert second is not first and files.created == 2 and files.reused == 0
    theirs2 = open_destination(SharedDestination.from_json(spec2.to_json()), mapped)
    files.unname(second)
    theirs2.buffer.fill_(2.0)
    assert bool((held == 1.0).all())  # the held rows were not written over
    del held, mine2, theirs2
    gc.collect()
    # Both idle: the larger one is kept (keep_idle=1) and handed out again; the smaller is unmapped.
    again, spec3, mine3 = _shared(files, (5, 2, 3), {3: (0, 5)})
    assert again is first and files.reused == 1 and files.keys() == [first.key]
    theirs3 = open_destination(SharedDestination.from_json(spec3.to_json()), mapped)
    assert list(mapped) == [first.key]  # the worker let go of the file the engine side unmapped
    theirs3.buffer[4] = 3.0
    assert bool((mine3.buffer[4] == 3.0).all()) and mine3.buffer.shape == (5, 2, 3)
    assert files.idle_bytes() == 0
    # 6 rows and a scratch row (84 bytes), then 7 token marks (at 128, aligned): files are sized
    # to a power of two
    assert first.nbytes == 256 and destination_nbytes(spec.shape, spec.dtype) == 156
    too_small = dataclasses.replace(spec3, shape=(24, 2, 3), slots={3: (0, 24)})
    with pytest.raises(ValueError, match="holds 256 bytes, the destination needs 420"):
        open_destination(too_small, mapped)
    del mine3, theirs3
    gc.collect()
    assert files.idle_bytes() == first.nbytes
    files.close()
    assert files.keys() == []


def test_a_worker_keeps_the_files_of_every_api_server_and_prunes_each_ones_by_its_own_list():
    """Several API server processes on one engine each have their files: one's list of files it
    still maps never unmaps another's (its name is gone once mapped: it could not be found again)."""
    from uhead_vllm.capture.protocol import SharedDestination
    from uhead_vllm.capture.row_files import open_destination
    from uhead_vllm.generation.shared_rows import SharedRowFiles

    a, b = SharedRowFiles(keep_idle=0), SharedRowFiles(keep_idle=0)
    mapped: dict = {}  # the worker's mappings
    file_a, spec_a, mine_a = _shared(a, (4, 2, 3), {1: (0, 4)})
    file_b, spec_b, mine_b = _shared(b, (4, 2, 3), {2: (0, 4)})
    for files, row_file, spec in ((a, file_a, spec_a), (b, file_b, spec_b)):
        open_destination(SharedDestination.from_json(spec.to_json()), mapped)
        files.unname(row_file)
    assert a.owner != b.owner and set(mapped) == {file_a.key, file_b.key}
    del mine_a
    gc.collect()  # a's file is idle and unmapped (keep_idle=0): a's next list drops it
    file_a2, spec_a2, mine_a2 = _shared(a, (4, 2, 3), {3: (0, 4)})
    theirs = open_destination(SharedDestination.from_json(spec_a2.to_json()), mapped)
    assert set(mapped) == {file_a2.key, file_b.key}  # b's file stays mapped for b's next call
    again_b = open_destination(dataclasses.replace(spec_b, keep=tuple(b.keys())), mapped)
    again_b.buffer.fill_(5.0)
    theirs.buffer.fill_(6.0)
    assert bool((mine_b.buffer == 5.0).all()) and bool((mine_a2.buffer == 6.0).all())


def test_placed_rows_cross_a_process_boundary_as_a_count():
    from uhead_vllm.capture.protocol import CapturedRows, decode_rows, encode_rows

    back = decode_rows(encode_rows(CapturedRows.placed_into_destination((0, 2), 7)))
    assert back.placed and back.num_rows == 7 and back.hidden_parts == [] and back.layers == (0, 2)
    none = decode_rows(encode_rows(CapturedRows.placed_into_destination((0, 2), 0)))
    assert none.placed and none.num_rows == 0
    with pytest.raises(ValueError, match="placed into the caller's RowDestination"):
        back.hidden


def test_host_buffer_is_a_writable_tensor_that_keeps_its_mapping_alive():
    from uhead_vllm.generation.host_memory import MIN_HUGE_BUFFER_BYTES, host_buffer

    rows = MIN_HUGE_BUFFER_BYTES // (2 * 64 * 2) + 7  # past the plain-allocation size, odd length
    with torch.inference_mode():  # made outside inference mode all the same (the store reads versions)
        buffer = host_buffer((rows, 2, 64), torch.bfloat16)
    assert buffer.shape == (rows, 2, 64) and buffer.dtype == torch.bfloat16 and not torch.is_inference(buffer)
    assert buffer.untyped_storage().nbytes() == rows * 2 * 64 * 2
    tail = buffer[-3:]
    buffer[-3:] = (torch.arange(3 * 2 * 64) % 200).view(3, 2, 64)
    assert buffer._version > 0
    del buffer
    import gc

    gc.collect()
    assert tail.float().flatten().tolist() == [float(i % 200) for i in range(3 * 2 * 64)]


def test_pinned_ring_hands_out_fifo_regions_and_never_one_still_being_placed():
    from uhead_vllm.capture.staging import PinnedRing

    ring = PinnedRing(256, pin=False)  # the bookkeeping is the same with or without pinning
    a, end_a = ring.take(100)  # [0, 128)
    b, end_b = ring.take(100)  # [128, 256)
    assert a.numel() == b.numel() == 100 and b.data_ptr() - a.data_ptr() == 128
    assert ring.take(1) is None  # full until the placer releases the oldest region
    ring.release(end_a)
    c, end_c = ring.take(64)  # the released room at the start
    assert c.data_ptr() == a.data_ptr()
    assert ring.take(100) is None  # 64 bytes left before b's region: never across b or the end
    ring.release(end_b)
    d, _ = ring.take(100)
    assert d.data_ptr() == a.data_ptr() + 64
    assert ring.take(300) is None  # larger than the ring: the caller allocates instead
    assert ring.take(65) is None  # 64 bytes left (c and d hold the rest)
    rows, _ = ring.host_copy(torch.zeros(3, 2, dtype=torch.bfloat16))
    assert rows.shape == (3, 2) and rows.dtype == torch.bfloat16 and rows.data_ptr() == a.data_ptr() + 192


def test_pinned_arena_hands_out_until_reset_then_reuses_its_chunks():
    from uhead_vllm.capture.staging import PinnedArena

    arena = PinnedArena(256, pin=False)
    meta = torch.zeros(2, 10, dtype=torch.int64)  # 160 bytes
    a, b = arena.host_copy(meta), arena.host_copy(meta)  # b does not fit after a: a second chunk
    assert a.shape == (2, 10) and a.dtype == torch.int64 and len(arena.chunks) == 2
    big = arena.host_copy(torch.zeros(100, dtype=torch.int64))  # 800 bytes: a chunk of its own
    assert len(arena.chunks) == 3 and arena.chunks[2].numel() == 832  # aligned to 64 bytes
    a.fill_(1), b.fill_(2), big.fill_(3)
    assert a.sum() == 20 and b.sum() == 40 and big.sum() == 300  # no overlap
    arena.reset()
    again = arena.host_copy(meta)
    assert again.data_ptr() == a.data_ptr() and len(arena.chunks) == 3  # nothing new allocated


def test_steps_queued_behind_one_wait_are_placed_in_order_and_a_failed_wait_fails_each_of_them():
    dest = RowDestination(torch.zeros(4, 1, 1), {1: (0, 4)})
    placer = Placer()
    first, later = Gate(), Gate()
    freed = []
    placer.submit(first, dest, torch.full((1, 1, 1), 1.0), meta([0]), slots([0], [4], [1]))
    for value in (2.0, 3.0, 4.0):  # queue up while the thread waits for the first copy; the last wins
        placer.submit(later, dest, torch.full((1, 1, 1), value), meta([1]), slots([0], [4], [1]),
                      done=lambda v=value: freed.append(v))
    first.opened.set()
    later.opened.set()
    assert placer.drain()[0] is None
    assert dest.buffer.flatten().tolist() == [1.0, 4.0, 0.0, 0.0] and freed == [2.0, 3.0, 4.0]

    class Broken:
        def synchronize(self) -> None:
            raise RuntimeError("device lost")

    placer.submit(Broken(), dest, torch.full((2, 1, 1), 9.0), meta([2, 3]), slots([0], [4], [2]),
                  done=lambda: freed.append("broken"))
    error, _ = placer.drain()
    assert error is not None and "device lost" in error
    assert dest.buffer.flatten().tolist() == [1.0, 4.0, 0.0, 0.0] and freed[-1] == "broken"


def test_the_engine_side_counts_a_row_only_where_its_mark_is_the_sequences_token():
    from types import SimpleNamespace

    from uhead_vllm.generation.first_pass import check_placed

    # two samples of the prompt [5, 6, 7] (tags 1, 2; slots of 5 rows); tag 1 forwards the prompt
    # and one generated row, tag 2 only its last prompt row and a generated one (the rest came from
    # the prefix cache); a third sequence (tag 3) got a wrong token at position 1
    dest = RowDestination(torch.zeros(15, 1, 1), {1: (0, 5), 2: (5, 5), 3: (10, 5)}, [(3, (1, 2))])
    chunks = slots([0, 5, 10], [5, 5, 5], [4, 2, 3], [dest.group_row[1], dest.group_row[2], -1])
    place_step(dest, torch.ones(9, 1, 1), meta([0, 1, 2, 3, 2, 3, 0, 1, 2], [5, 6, 7, 8, 7, 9, 5, 0, 7]), chunks)

    def seq(index, ids, prompt=(5, 6, 7)):
        return SimpleNamespace(ids=np.array(ids), prompt_index=index,
                               request_output=SimpleNamespace(prompt_token_ids=list(prompt)))

    seqs = [seq(0, [5, 6, 7, 8]), seq(0, [5, 6, 7, 9]), seq(1, [5, 6, 7])]
    rendered = [({"prompt_token_ids": [5, 6, 7]}, "a"), ({"prompt_token_ids": [5, 6, 7]}, "b")]
    lens, first, capacity = np.array([4, 4, 3]), np.array([0, 5, 10]), np.array([5, 5, 5])
    check = check_placed
    shared, valid = check(seqs, lens, first, capacity, dest.marks, rendered)
    # tag 2's positions 0-1 came from tag 1 (shared, counted); the wrong token never counts
    assert valid.tolist() == [True] * 8 + [True, False, True] and shared == 2
    # vLLM ran another prompt than the groups were built from: shared rows no longer count
    seqs[1].request_output.prompt_token_ids = [5, 6, 4]
    shared, valid = check(seqs, lens, first, capacity, dest.marks, rendered)
    assert valid.tolist() == [True] * 4 + [False, False, True, True] + [True, False, True] and shared == 0
    # a slot shorter than its sequence (vLLM's prompt longer than planned): rows past it are invalid
    shared, valid = check(seqs[:1], np.array([4]), np.array([0]), np.array([2]), dest.marks, rendered)
    assert valid.tolist() == [True, True, False, False]


def test_the_placer_thread_writes_a_large_step_as_place_step_does():
    from uhead_vllm.capture import placer as placer_module

    n, width = 2048, 1024  # 8 MiB of float32 rows
    slots_of = {t: (t * 64, 64) for t in range(64)}
    groups = [(8, tuple(range(g, g + 4))) for g in range(0, 64, 4)]
    rows = torch.randn(n, 1, width)
    positions = torch.arange(32).repeat(64)  # 64 requests x 32 prompt rows; the first 8 shared by groups of 4
    per_request = rows.view(64, 32, 1, width)
    per_request[:, :8] = per_request[::4, :8].repeat_interleave(4, 0)  # a shared prefix: the same rows
    tags = list(range(64))
    expected_dest = RowDestination(torch.zeros(64 * 64, 1, width), slots_of, groups)
    chunks = slots([slots_of[t][0] for t in tags], [64] * 64, [32] * 64, [expected_dest.group_row[t] for t in tags])
    placer_module.place_step(expected_dest, rows, meta(positions), chunks)  # one thread
    dest = RowDestination(torch.zeros(64 * 64, 1, width), slots_of, groups)
    placer = Placer()
    gate = Gate()
    placer.submit(gate, dest, rows, meta(positions), chunks)  # the placer thread
    gate.opened.set()
    assert placer.drain()[0] is None
    assert torch.equal(dest.buffer, expected_dest.buffer) and bool(dest.buffer.abs().sum(-1).gt(0).sum() == 64 * 32)


def test_shared_row_files_refuse_rows_the_file_system_has_no_room_for(tmp_path, monkeypatch):
    from uhead_vllm.generation import shared_rows
    from uhead_vllm.generation.shared_rows import SharedRowFiles

    files = SharedRowFiles(directory=str(tmp_path))
    row_file, flat = files.take(4096)
    files.unname(row_file)
    del flat
    gc.collect()
    real = os.statvfs(tmp_path)
    free = max(1, 4096 // real.f_frsize)  # 4 KiB left
    monkeypatch.setattr(shared_rows.os, "statvfs", lambda path: os.statvfs_result(
        (real.f_bsize, real.f_frsize, real.f_blocks, free, free) + tuple(real)[5:]))
    assert files.take(8192) is None  # a write past the room would kill the worker with SIGBUS
    again = files.take(2048)
    assert again is not None and again[0] is row_file and again[1].numel() == 2048
    assert files.created == 1 and files.reused == 1 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("writes", ["placer", "file-writer"])
def test_steps_batched_in_a_buffer_land_where_each_step_alone_would(monkeypatch, model_dtype, writes):
    """The recorder's batched route (rows of several steps gathered in one buffer, flushed every
    few steps or when full, a prefill larger than the buffer copied on its own in between) puts
    every tagged row at its slot and keeps metadata in recording order; an untagged request
    between tagged ones splits a step into two runs. ``file-writer``: the batches are written by
    the scatter a GPU runs into its row file (file_writer.py), here on CPU tensors."""
    from uhead_vllm.adapters import ScheduledStep, StepOutputs
    from uhead_vllm.capture import step_batch
    from uhead_vllm.capture.file_writer import FileWriter
    from uhead_vllm.capture.protocol import CaptureSettings, RequestTag
    from uhead_vllm.capture.row_files import destination_nbytes, file_views
    from uhead_vllm.capture.recorder import RowRecorder

    monkeypatch.setattr(step_batch, "BUFFER_BYTES", 8 * 2 * 4 * 2)  # 8 rows of 2 columns x 4 bf16
    monkeypatch.setattr(step_batch, "MAX_STEPS", 3)
    layers, hidden, prompt, decode = (0, 2), 4, 5, 10
    rec = RowRecorder(CaptureSettings(layers=layers, dtype="bfloat16"), aux_layers=(0, 1, 2), hidden_size=hidden)
    capacity = prompt + decode
    shape = (3 * capacity, 2, hidden)
    byte_rows, marks = file_views(torch.zeros(destination_nbytes(shape, "bfloat16"), dtype=torch.uint8), shape,
                                  "bfloat16")
    buffer = byte_rows[: shape[0]].view(torch.bfloat16).view(shape)
    buffer.fill_(-1.0)
    marks.fill_(-1)
    dest = RowDestination(buffer, {t: (t * capacity, capacity) for t in range(3)}, tokens=marks[: shape[0]])
    rec.place_into(dest, FileWriter(byte_rows, marks) if writes == "file-writer" else None)
    req_ids = ["a", "x", "b", "c"]  # "x" is not captured
    tags = {"a": 0, "b": 1, "c": 2}

    def value(layer: int, req: int, pos: int) -> float:
        return layer * 100 + req * 20 + pos + 0.5

    for step in range(decode + 1):
        new = [(r, RequestTag(tags[r], 0).to_extra_args() if r in tags else None) for r in req_ids] if not step else []
        n = prompt if not step else 1
        rec.on_schedule(ScheduledStep(new, {r: n for r in req_ids}, set()))
        start = 0 if not step else prompt + step - 1
        pos = torch.arange(start, start + n).repeat(len(req_ids))
        req = torch.arange(len(req_ids)).repeat_interleave(n)
        aux = [torch.stack([torch.full((hidden,), value(j, int(q), int(p))) for q, p in zip(req, pos)]).to(model_dtype)
               for j in range(3)]
        ids = (pos + 1000 * req).to(torch.int32)
        rec.on_forward(StepOutputs(req_ids, np.arange(len(req_ids) + 1, dtype=np.int32) * n, pos, ids, aux))
    with pytest.raises(RuntimeError, match="still held"):  # the last steps wait in the buffer
        rec.place_into(dest)
    rows = rec.take()
    assert rows.error is None and rows.placed and rows.num_rows == 3 * (prompt + decode)
    assert rows.stats["rows_written_on_device"] == (rows.num_rows if writes == "file-writer" else 0)
    assert rec.rows_recorded == 0 and not rec.held.holds_rows()  # taken: afresh
    for r, t in tags.items():
        q = req_ids.index(r)
        want = torch.tensor([[[value(j, q, p)] * hidden for j in layers] for p in range(capacity)]).to(model_dtype)
        assert torch.equal(dest.buffer[t * capacity : (t + 1) * capacity], want.to(torch.bfloat16)), r
        # each row's input token marks its place: the engine side checks rows by these alone
        assert dest.tokens[t * capacity : (t + 1) * capacity].tolist() == [p + 1000 * q for p in range(capacity)]
    assert rows.tags.numel() == 0 and rows.hidden_parts == []  # placed rows come back as a count


def test_a_batch_is_sent_once_it_holds_flush_rows_rows_or_max_steps_steps(monkeypatch):
    """A batch is sent at MAX_STEPS steps or FLUSH_ROWS rows, whichever comes first; every row
    arrives, in order."""
    from uhead_vllm.capture import step_batch

    monkeypatch.setattr(step_batch, "FLUSH_ROWS", 7)
    monkeypatch.setattr(step_batch, "MAX_STEPS", 4)
    sent: list[tuple[list, torch.Tensor]] = []
    batcher = step_batch.StepBatcher(1, 2, torch.float32, lambda steps, rows, meta: sent.append((steps, rows.clone())))
    source = torch.arange(40, dtype=torch.float32).reshape(20, 1, 2).expand(20, 1, 2)
    ids = torch.arange(20)
    step = 0
    for rows in (1, 1, 1, 1, 1, 3, 3, 3):  # 4 steps of 1 row (MAX_STEPS), then 3+3+3 rows (FLUSH_ROWS)
        batcher.add(step, [source[:, 0]], ids, ids, [(step, step + rows)], rows)
        step += rows
    batcher.flush()
    assert [[facts for facts, _ in steps] for steps, _ in sent] == [[0, 1, 2, 3], [4, 5, 8], [11]]
    assert torch.equal(torch.cat([rows for _, rows in sent])[:, 0], source[:14, 0])


def test_the_batch_limits_come_from_the_engine_environment_when_given(monkeypatch):
    from uhead_vllm.capture import step_batch

    def limits() -> tuple[int, int]:
        batcher = step_batch.StepBatcher(1, 2, torch.float32, None)  # type: ignore[arg-type]
        return batcher.max_steps, batcher.flush_rows

    assert limits() == (step_batch.MAX_STEPS, step_batch.FLUSH_ROWS)
    monkeypatch.setenv(STEP_BATCH_ENV, "16,1000000")
    assert limits() == (16, 1000000)
    for bad in ("16", "a,b", "0,5"):
        monkeypatch.setenv(STEP_BATCH_ENV, bad)
        with pytest.raises(ValueError, match="STEPS,ROWS"):
            limits()


def test_a_placement_settles_once_and_always_lets_go_of_the_file_name():
    """The destination is handed over without waiting; ``settle`` reads the worker's answer once:
    a refusal drops the destination (rows then come with the fetch), an error propagates, and the
    file's name is removed either way."""
    from uhead_vllm.generation.backends import Placement

    dest = RowDestination(torch.zeros(2, 1, 1), {1: (0, 2)})
    unnamed, asked = [], []
    accepted = Placement(dest, lambda: asked.append(1) or True, lambda: unnamed.append("ok"))
    assert accepted.settle() is dest and accepted.settle() is dest and asked == [1] and unnamed == ["ok"]
    assert Placement(dest, lambda: False, lambda: unnamed.append("no")).settle() is None and unnamed[-1] == "no"

    def fails() -> bool:
        raise RuntimeError("worker failed")

    with pytest.raises(RuntimeError, match="worker failed"):
        Placement(dest, fails, lambda: unnamed.append("failed")).settle()
    assert unnamed[-1] == "failed"
    assert Placement(None).settle() is None


@pytest.mark.parametrize("sink", ["held", "placer", "file-writer"])
def test_rows_below_a_capture_window_are_never_recorded_nor_counted_as_missed(sink):
    """Requests whose tags open a capture window at ``start``: a chunked prefill straddling it
    keeps its tail, a chunk wholly below it has no rows, a prefix-cache hit starts past it, and
    the steady decode steps (every window reached) record every row. Rows below the windows are
    neither expected nor recorded (counted as skipped); every sink gets exactly the window rows."""
    from uhead_vllm.adapters import ScheduledStep, StepOutputs
    from uhead_vllm.capture.file_writer import FileWriter
    from uhead_vllm.capture.protocol import CaptureSettings, RequestTag
    from uhead_vllm.capture.recorder import RowRecorder
    from uhead_vllm.capture.row_files import destination_nbytes, file_views

    hidden, prompt, decode = 2, 6, 3
    rec = RowRecorder(CaptureSettings(layers=(0,)), aux_layers=(0,), hidden_size=hidden)
    # request -> (tag, window start, tokens already computed when first scheduled: a prefix-cache hit)
    reqs = {"a": (0, 0, 0), "b": (1, 3, 0), "x": (None, 0, 0), "c": (2, 5, 0), "d": (3, 2, 4)}
    capacity = prompt + decode
    shape = (4 * capacity, 1, hidden)
    byte_rows, marks = file_views(torch.zeros(destination_nbytes(shape, "float32"), dtype=torch.uint8), shape, "float32")
    buffer = byte_rows[: shape[0]].view(torch.float32).view(shape)
    marks.fill_(-1)
    dest = RowDestination(buffer, {t: (t * capacity, capacity) for t, _, _ in reqs.values() if t is not None},
                          tokens=marks[: shape[0]])
    if sink != "held":
        rec.place_into(dest, FileWriter(byte_rows, marks) if sink == "file-writer" else None)
    done = {r: c for r, (_, _, c) in reqs.items()}
    req_ids = list(reqs)
    for step in range(2 + decode):
        new = [(r, None if t is None else RequestTag(t, 0, s).to_extra_args()) for r, (t, s, _) in reqs.items()] \
            if not step else []
        n = {r: (min(4, prompt - done[r]) if done[r] < prompt else int(done[r] < capacity)) for r in req_ids}
        running = [r for r in req_ids if step and n[r]]
        rec.on_schedule(ScheduledStep(new, {r: k for r, k in n.items() if k}, set(),
                                      new_computed={r: done[r] for r, _ in new},
                                      running_ids=running, running_computed=[done[r] for r in running]))
        pos = torch.cat([torch.arange(done[r], done[r] + n[r]) for r in req_ids])
        owner = torch.cat([torch.full((n[r],), k) for k, r in enumerate(req_ids)])
        aux = [torch.stack([pos.float() + 100 * owner] * hidden, dim=1)]
        qsl = np.concatenate([[0], np.cumsum([n[r] for r in req_ids])]).astype(np.int32)
        rec.on_forward(StepOutputs(req_ids, qsl, pos, (pos + 1000 * owner).to(torch.int32), aux))
        done = {r: done[r] + n[r] for r in req_ids}
    assert rec.tags.windows == {}  # every window reached: decode steps cost nothing more
    rows = rec.take()
    window = {r: range(max(s, c), prompt + decode) for r, (t, s, c) in reqs.items() if t is not None}
    want_rows = sum(len(w) for w in window.values())
    skipped = sum(max(0, s - c) for t, s, c in reqs.values() if t is not None)
    assert rows.error is None and rows.num_rows == want_rows
    assert rows.stats["rows_expected"] == rows.stats["rows_recorded"] == want_rows
    assert rows.stats["rows_skipped"] == skipped == 3 + 5
    assert rows.stats["bytes_to_host"] == want_rows * hidden * 4
    for r, w in window.items():
        t, k = reqs[r][0], req_ids.index(r)
        if sink == "held":
            got = sorted(rows.positions[rows.tags == t].tolist())
            assert got == list(w), r
            assert torch.equal(rows.hidden[rows.tags == t][:, 0, 0], rows.positions[rows.tags == t].float() + 100 * k)
        else:
            m = dest.tokens[t * capacity : (t + 1) * capacity].tolist()
            assert [p for p in range(capacity) if m[p] >= 0] == list(w), r
            assert dest.buffer[t * capacity + w[0] : t * capacity + capacity, 0, 0].tolist() == [p + 100 * k for p in w]


def test_a_group_member_gets_no_shared_row_below_its_capture_window():
    """Tags 1 and 2 share a 4-token prompt; tag 2's window starts at 3: of tag 1's prompt rows only
    position 3 is written into tag 2's slot."""
    dest = RowDestination(torch.zeros(12, 1, 1), {1: (0, 6), 2: (6, 6)}, [(4, (1, 2))], starts={2: 3})
    place_step(dest, torch.tensor([10.0, 11, 12, 13, 14]).view(5, 1, 1), meta([0, 1, 2, 3, 4]),
               slots([0], [6], [5], [dest.group_row[1]]))
    assert dest.buffer.flatten().tolist() == [10, 11, 12, 13, 14, 0, 0, 0, 0, 13, 0, 0]
    assert dest.tokens[6:].tolist() == [-1, -1, -1, -2 - 103, -1, -1]
