"""The device's row-file writer (capture/file_writer.py), run with CPU tensors: torch's scatter (a
GPU's fallback) and the GPU's Triton kernels in Triton's interpreter (scatter_kernel.py), checked
against the host placer (placer.place_step), which they replace there."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from uhead_vllm.capture import file_writer, scatter_kernel
from uhead_vllm.capture.file_writer import FileWriter, RegisteredFiles
from uhead_vllm.envs import FILE_WRITES_ENV
from uhead_vllm.capture.placer import ChunkSlots, place_step, share_written_rows
from uhead_vllm.capture.destination import RowDestination
from uhead_vllm.capture.row_files import destination_nbytes, file_views

SHAPE = (60, 2, 3)  # rows, columns, hidden


def file_destination(slots: dict, groups=(), shape=SHAPE, dtype: str = "float32"
                     ) -> tuple[RowDestination, FileWriter, torch.Tensor]:
    """A row file's destination (as the worker maps it), its writer and the whole file."""
    flat = torch.zeros(destination_nbytes(shape, dtype), dtype=torch.uint8)
    byte_rows, marks = file_views(flat, shape, dtype)
    marks.fill_(-1)
    dest = RowDestination(byte_rows[: shape[0]].view(getattr(torch, dtype)).view(shape), dict(slots), list(groups),
                          marks[: shape[0]])
    return dest, FileWriter(byte_rows, marks), flat


def write(dest: RowDestination, writer: FileWriter, hidden: torch.Tensor, meta: torch.Tensor, chunks: ChunkSlots) -> None:
    """What the recorder does at a flush with a writer, in one thread."""
    first, capacity = chunks.per_row()
    writer.write(hidden, meta, torch.from_numpy(first), torch.from_numpy(capacity))
    share_written_rows(dest, meta, chunks)


def test_rows_past_their_slot_go_to_scratch_and_the_last_row_for_a_place_wins():
    dest, writer, _ = file_destination({7: (0, 3), 8: (3, 3)}, shape=(6, 1, 1))
    rows = torch.arange(1, 8, dtype=torch.float32).view(7, 1, 1)
    # tag 7 at 0, 1; an unknown tag (no slot) at 2; tag 7 at 1 again; tag 8 at 0, 0, then 3 (past its slot)
    meta = torch.tensor([[0, 1, 2, 1, 0, 0, 3], [100, 101, 102, 103, 104, 105, 106]])
    write(dest, writer, rows, meta, ChunkSlots(np.array([0, -1, 0, 3]), np.array([3, 0, 3, 3]),
                                               np.array([2, 1, 1, 3])))
    assert dest.buffer.flatten().tolist() == [1.0, 4.0, 0.0, 6.0, 0.0, 0.0]
    assert dest.tokens.tolist() == [100, 103, -1, 105, -1, -1]


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """The GPU scatter kernel (scatter_kernel.py) run by Triton's interpreter on CPU tensors."""
    if scatter_kernel.triton is None:
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(scatter_kernel)
    yield
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(scatter_kernel)


@pytest.mark.parametrize("columns, hidden_size, dtype, word, misaligned", [
    (2, 3, "float32", torch.int64, False),  # 24-byte rows: 8-byte words
    (1, 3, "float32", torch.int32, False),  # 12-byte rows
    (1, 3, "bfloat16", torch.int16, False),  # 6-byte rows
    (2, 3, "float32", torch.int64, True),  # rows at an address 8 does not divide: copied as bytes
])
def test_the_file_writer_puts_every_row_where_the_placer_does(columns, hidden_size, dtype, word, misaligned):
    """Random batches (several steps joined: prompt chunks, decode rows, positions forwarded twice,
    rows past a slot, rows of no slot) into slots with nested prefix groups: rows and marks equal
    the host placer's, bit for bit, whatever words the rows are copied as."""
    writes_like_the_placer(columns, hidden_size, dtype, word, misaligned)


@pytest.mark.parametrize("columns, hidden_size, dtype, word", [(2, 3, "float32", torch.int64),
                                                               (1, 3, "bfloat16", torch.int16)])
def test_the_scatter_kernel_puts_every_row_where_the_placer_does(interpreted_kernel, columns, hidden_size, dtype,
                                                                  word):
    """The same with the rows and marks written by the GPU's kernels (places claimed, then a few
    programs each walking tiles of rows), as Triton's interpreter runs them."""
    writes_like_the_placer(columns, hidden_size, dtype, word, False, kernel=True, batches=12)


def writes_like_the_placer(columns: int, hidden_size: int, dtype: str, word: torch.dtype, misaligned: bool,
                           kernel: bool = False, batches: int = 40) -> None:
    """Random batches into a row file and into the placer's destination: the same rows and marks."""
    rng, values_rng = np.random.default_rng(0), np.random.default_rng(1)  # batches, rows
    tags = list(range(6))
    slots = {t: (10 * t, 10) for t in tags}
    groups = [(6, (0, 1, 2, 3)), (8, (0, 1)), (5, (4, 5))]
    shape, torch_dtype = (SHAPE[0], columns, hidden_size), getattr(torch, dtype)
    dest, writer, _ = file_destination(slots, groups, shape, dtype)
    assert writer.word == word
    writer.kernel = kernel  # on CPU tensors only where the interpreter runs it
    if kernel:  # as the worker does when it makes the writer: compiles, writes nothing
        file_writer._WARMED.clear()
        writer.warm_up()
        assert file_writer._WARMED and writer._flushes == 1
    calls = []
    if kernel:
        original = scatter_kernel.scatter_rows
        scatter_kernel.scatter_rows = lambda *args: calls.append(1) or original(*args)
    reference = RowDestination(torch.zeros(shape, dtype=torch_dtype), dict(slots), list(groups))
    reference.tokens.fill_(-1)
    for _ in range(batches):
        firsts, caps, lens, group_rows, positions = [], [], [], [], []
        for _ in range(int(rng.integers(1, 6))):
            tag = int(rng.integers(-1, len(tags)))
            n = int(rng.integers(1, 5))
            start = int(rng.integers(0, 11))
            first, cap = slots.get(tag, (-1, 0))
            firsts.append(first), caps.append(cap), lens.append(n)
            group_rows.append(dest.group_row.get(tag, -1))
            positions += range(start, start + n)
        meta = torch.stack([torch.tensor(positions), torch.from_numpy(rng.integers(0, 500, len(positions)))])
        n = len(positions) * columns * hidden_size
        values = torch.from_numpy(values_rng.standard_normal(n + 1).astype(np.float32)).to(torch_dtype)
        hidden = values[int(misaligned) :][:n].view(len(positions), columns, hidden_size)
        assert hidden.data_ptr() % 8 == (4 if misaligned else 0)  # misaligned: 4 bytes into its memory
        chunks = ChunkSlots(*(np.asarray(x, dtype=np.int64) for x in (firsts, caps, lens, group_rows)))
        place_step(reference, hidden, meta, chunks)
        write(dest, writer, hidden, meta, chunks)
    if kernel:
        scatter_kernel.scatter_rows = original
        assert len(calls) == batches
    assert (reference.tokens >= 0).sum() > batches and (reference.tokens < -1).sum() > 2  # own and shared rows
    assert torch.equal(dest.tokens, reference.tokens)
    assert torch.equal(dest.buffer, reference.buffer)


def test_a_writer_refuses_rows_of_another_width():
    _, writer, _ = file_destination({1: (0, 4)})
    with pytest.raises(ValueError, match="rows of 48 bytes for a row file of 24-byte rows"):
        writer.write(torch.zeros(2, 2, 6), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                     torch.ones(2, dtype=torch.int64))


def test_the_worker_writes_row_files_itself_where_its_kernels_run_or_when_asked(monkeypatch):
    _, _, flat = file_destination({1: (0, 4)})
    files = RegisteredFiles()
    cpu = torch.device("cpu")
    monkeypatch.delenv(FILE_WRITES_ENV, raising=False)
    assert files.writer("k", flat, SHAPE, "float32", cpu) is None  # the placer by default where the kernels cannot run
    monkeypatch.setattr(scatter_kernel, "available", lambda device: True)
    assert files.writer("k", flat, SHAPE, "float32", cpu) is not None  # the device by default where they can
    monkeypatch.undo()
    monkeypatch.setenv(FILE_WRITES_ENV, "0")
    assert files.writer("k", flat, SHAPE, "float32", cpu) is None
    monkeypatch.setenv(FILE_WRITES_ENV, "1")
    writer = files.writer("k", flat, SHAPE, "float32", cpu)
    assert writer is not None and writer.scratch == SHAPE[0]
    assert files.writer("", flat, SHAPE, "float32", cpu) is None  # a buffer of this process, not a file
    # The engine side's choice, sent with the destination, goes before the worker's environment.
    assert files.writer("k", flat, SHAPE, "float32", cpu, asked=False) is None
    monkeypatch.setenv(FILE_WRITES_ENV, "0")
    assert files.writer("k", flat, SHAPE, "float32", cpu, asked=True) is not None
    monkeypatch.setenv(FILE_WRITES_ENV, "yes")
    with pytest.raises(ValueError, match="UHEAD_FILE_WRITES='yes': expected 1"):
        files.writer("k", flat, SHAPE, "float32", cpu)


def test_every_row_but_the_last_for_a_place_is_sent_to_scratch():
    """On CPU ``index_copy_`` writes duplicates in order, so the comparison above cannot see this;
    a GPU writes them in any order, so the writer keeps only the last row for each place."""
    _, writer, _ = file_destination({1: (0, 8)})
    s = writer.scratch
    assert writer._last_wins(torch.tensor([3, 1, 3, 2, 1, s, s])).tolist() == [s, s, 3, 2, 1, s, s]
    assert writer._last_wins(torch.tensor([3, 1])).tolist() == [3, 1]  # again: earlier calls do not count


def test_a_writer_that_fails_hands_its_rows_and_the_rest_to_the_host_placer():
    from uhead_vllm.adapters import ScheduledStep, StepOutputs
    from uhead_vllm.capture.protocol import CaptureSettings, RequestTag
    from uhead_vllm.capture.recorder import RowRecorder

    rec = RowRecorder(CaptureSettings(layers=(0, 1), dtype="float32"), aux_layers=(0, 1), hidden_size=3)
    dest, _, _ = file_destination({5: (0, 10)})
    _, wrong_width, _ = file_destination({5: (0, 10)}, shape=(60, 1, 3))
    rec.place_into(dest, wrong_width)
    rec.on_schedule(ScheduledStep([("r", RequestTag(5, 0).to_extra_args())], {"r": 4}, set()))
    aux = [torch.arange(12, dtype=torch.float32).view(4, 3) + 100 * j for j in range(2)]
    with pytest.warns(RuntimeWarning, match="the host placer takes over: ValueError"):
        rec.on_forward(StepOutputs(["r"], np.array([0, 4], dtype=np.int32), torch.arange(4), torch.arange(4) + 7, aux))
        rows = rec.take()
    assert rows.error is None and rows.placed_rows == 4 and rows.stats["rows_written_on_device"] == 0
    assert torch.equal(dest.buffer[:4], torch.stack(aux, dim=1)) and dest.tokens[:5].tolist() == [7, 8, 9, 10, -1]


def test_a_writer_first_used_in_inference_mode_writes_outside_it_too():
    """Steps are written from vLLM's forward (inference mode), the last batch at the fetch (not):
    on a GPU host this once sent every call's last batch to the host placer."""
    dest, writer, _ = file_destination({1: (0, 8)})
    rows = torch.ones(2, 2, 3)
    meta = torch.tensor([[0, 1], [5, 6]])
    places = (torch.zeros(2, dtype=torch.int64), torch.full((2,), 8))
    with torch.inference_mode():
        writer.write(rows, meta, *places)
    writer.write(2 * rows, meta + torch.tensor([[2], [0]]), *places)
    assert dest.tokens[:5].tolist() == [5, 6, 5, 6, -1] and float(dest.buffer[:4].sum()) == 2 * 6 + 4 * 6


def test_each_way_keeps_its_batcher_and_the_devices_buffers_are_larger():
    """Calls alternating who writes the rows reuse their way's step batcher (its buffers and step
    graphs); the device's way batches more rows (each flush costs the engine's thread launches)."""
    from uhead_vllm.adapters import ScheduledStep, StepOutputs
    from uhead_vllm.capture import step_batch
    from uhead_vllm.capture.protocol import CaptureSettings, RequestTag
    from uhead_vllm.capture.recorder import RowRecorder

    rec = RowRecorder(CaptureSettings(layers=(0, 1), dtype="float32"), aux_layers=(0, 1), hidden_size=3)
    seen = {}
    for call, writes in enumerate([False, True, False, True]):
        dest, writer, _ = file_destination({call: (0, 10)})
        rec.place_into(dest, writer if writes else None)
        rec.on_schedule(ScheduledStep([(f"r{call}", RequestTag(call, 0).to_extra_args())], {f"r{call}": 4}, set()))
        aux = [torch.arange(12, dtype=torch.float32).view(4, 3) + 100 * j + call for j in range(2)]
        rec.on_forward(StepOutputs([f"r{call}"], np.array([0, 4], dtype=np.int32), torch.arange(4),
                                   torch.arange(4) + 7, aux))
        rows = rec.take()
        assert rows.error is None and rows.stats["rows_written_on_device"] == (4 if writes else 0)
        assert torch.equal(dest.buffer[:4], torch.stack(aux, dim=1))
        assert seen.setdefault(writes, rec._batcher) is rec._batcher
    row_bytes = 2 * 3 * 4
    assert seen[False].capacity == step_batch.BUFFER_BYTES // row_bytes
    assert seen[True].capacity == step_batch.WRITER_BUFFER_BYTES // row_bytes
