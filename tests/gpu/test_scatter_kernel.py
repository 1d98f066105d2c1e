"""The row-file writer on a GPU, its Triton kernels (capture/scatter_kernel.py) and torch's ops,
write what the host would: each place's last row and its token, nothing of rows past their slot or
of no slot. Skipped where no GPU is present (CI runs the kernels in Triton's interpreter instead,
tests/test_file_writer.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("programs", [8, 0])  # the kernel; index_copy_
def test_the_device_writes_each_places_last_row_and_token_into_the_registered_file(programs):
    from experiments.gpu.writer_words import shared_file  # a /dev/shm file, mapped as the worker maps row files
    from uhead_vllm.capture.file_writer import FileWriter, RegisteredFiles
    from uhead_vllm.capture.row_files import destination_nbytes, file_views

    shape, dtype = (5000, 3, 576), "bfloat16"
    flat = shared_file(destination_nbytes(shape, dtype))
    files = RegisteredFiles()
    device = torch.device("cuda")
    registered = files.writer("test", flat, shape, dtype, device, asked=True)
    assert registered is not None and registered.word == torch.int64
    writer = FileWriter(registered.byte_rows, registered.marks, programs=programs)
    assert writer.kernel == bool(programs)
    host_rows, host_marks = file_views(flat, shape, dtype)
    host_marks.fill_(-1)
    rng = np.random.default_rng(0)
    expected_rows = torch.zeros_like(host_rows[: shape[0]])
    expected_marks = torch.full((shape[0],), -1, dtype=torch.int32)
    for n in (4096, 700):  # two flushes: the second's rows replace the first's at the places they share
        positions = torch.from_numpy(rng.integers(0, 1300, n))  # repeats: the same place forwarded again
        first = torch.from_numpy(rng.choice([0, 1300, 2600, -1], n))  # -1 with capacity 0: a row of no slot
        capacity = torch.where(first >= 0, 1200, 0)  # positions 1200+ lie past their slot
        tokens = torch.from_numpy(rng.integers(0, 50_000, n))
        hidden = torch.randn((n, 3, 576), dtype=torch.bfloat16, device=device)
        meta = torch.stack([positions, tokens]).to(device)
        writer.write(hidden, meta, first.to(device), capacity.to(device))
        rows_bytes = hidden.cpu().view(n, -1).view(torch.uint8)
        written = 0
        for r in range(n):  # in order: the last row for a place wins
            p, f, c = int(positions[r]), int(first[r]), int(capacity[r])
            if f >= 0 and p < c:
                expected_rows[f + p] = rows_bytes[r]
                expected_marks[f + p] = int(tokens[r])
                written += 1
        assert written > 0.6 * n
    assert (expected_marks >= 0).sum() < 2500  # places written twice, within and across the flushes
    torch.cuda.synchronize()
    assert torch.equal(host_marks[: shape[0]], expected_marks)
    assert torch.equal(host_rows[: shape[0]], expected_rows)
    files.keep_only(set())
