"""The device's row-file writer on a GPU, without vLLM: how fast it scatters a flush into a
registered host file by the word it copies with, and how much it slows a GPU-bound stream beside it.

``FileWriter`` (``uhead_vllm/capture/file_writer.py``) copies rows with ``index_copy_``, one element
per GPU thread. Bytes (as first built) make a warp's store 32 bytes wide; 8-byte words make it 256.
For a flush of each shape's rows (SmolLM2's 3 x 576 bf16 columns, an 8B model's 3 x 4096; 256 and
4096 rows to random places of a registered ``/dev/shm`` file, as the worker registers its row
files) this times, with CUDA events on a side stream (medians):

- the writer with bytes and with its widest word (torch's ``index_copy_`` over the whole GPU), its
  Triton kernel on a few programs (:data:`KERNEL_PROGRAMS`), and the copy engine moving the same
  bytes to pinned memory (what the placer path starts with), checking that the rows arrive;
- a chain of bf16 matmuls on the main stream (a GPU-bound forward stand-in) alone and with eight
  writer flushes (or eight copy-engine copies) queued beside it on the side stream.

    python -m experiments.gpu.writer_words --out DIR
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
from pathlib import Path
from typing import Callable

import torch

from experiments import provenance
from uhead_vllm.capture.file_writer import FileWriter, RegisteredFiles
from uhead_vllm.capture.row_files import destination_nbytes, file_views

SHAPES = {"smollm2": (3, 576), "llama8b": (3, 4096)}
#: Program counts of the scatter kernel (scatter_kernel.py) measured beside index_copy_'s whole GPU.
KERNEL_PROGRAMS = (4, 8, 16, 32, 132)
FILE_ROWS = 40_000  # a 256-sequence call's rows, rounded up
REPS = 20


def shared_file(nbytes: int) -> torch.Tensor:
    """An unlinked ``/dev/shm`` file of ``nbytes``, mapped and touched, as a uint8 tensor."""
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="uhead-words-")
    try:
        os.ftruncate(fd, nbytes)
        memory = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)
    flat = torch.frombuffer(memory, dtype=torch.uint8)
    flat[::4096] = 0
    return flat


def timed_ms(work: Callable[[], None], stream: torch.cuda.Stream, reps: int = REPS) -> float:
    """Median device time of ``work`` queued on ``stream``."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            work()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def beside(main_work: Callable[[], None], side_work: Callable[[], None] | None, side: torch.cuda.Stream) -> float:
    """Median ms of ``main_work`` on the main stream while ``side_work`` runs 8 times on ``side``."""
    main = torch.cuda.current_stream()
    times = []
    for _ in range(7):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        side.wait_stream(main)
        main_work()
        if side_work is not None:
            with torch.cuda.stream(side):
                for _ in range(8):
                    side_work()
        end.record(main)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)

    def matmuls() -> None:  # ~60 ms of tensor-core work on an H100
        for _ in range(40):
            torch.mm(a, a)

    results: dict = {"matmuls_alone_ms": beside(matmuls, None, side)}
    for name, (columns, width) in SHAPES.items():
        shape = (FILE_ROWS, columns, width)
        flat = shared_file(destination_nbytes(shape, "bfloat16"))
        registered = RegisteredFiles()  # registers the file as the worker does a row file
        widest = registered.writer(name, flat, shape, "bfloat16", device, asked=True)
        if widest is None:
            raise RuntimeError("the file could not be registered")
        writers = {"bytes": FileWriter(widest.byte_rows, widest.marks, torch.uint8, programs=0),
                   "widest": FileWriter(widest.byte_rows, widest.marks, programs=0),
                   **{f"kernel{p}": FileWriter(widest.byte_rows, widest.marks, programs=p) for p in KERNEL_PROGRAMS}}
        host_rows, _ = file_views(flat, shape, "bfloat16")
        for n in (256, 4096):
            hidden = torch.randn(n, columns, width, dtype=torch.bfloat16, device=device)
            places = torch.randperm(FILE_ROWS, device=device)[:n]
            meta = torch.stack([places, torch.arange(n, device=device)])
            first, capacity = torch.zeros(n, dtype=torch.int64, device=device), torch.full((n,), FILE_ROWS, device=device)
            pinned = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
            row = {"row_bytes": columns * width * 2, "rows": n,
                   "copy_engine_to_pinned_ms": timed_ms(lambda: pinned.copy_(hidden, non_blocking=True), side)}
            for word, writer in writers.items():
                host_rows[places.cpu()] = 0
                row[f"writer_{word}_ms"] = timed_ms(lambda: writer.write(hidden, meta, first, capacity), side)
                torch.cuda.synchronize()
                arrived = host_rows[places.cpu()].view(torch.bfloat16).view(n, columns, width)
                row[f"writer_{word}_rows_arrived"] = bool(torch.equal(arrived, hidden.cpu()))
                row[f"writer_{word}_word"] = str(writer.word)
                row[f"writer_{word}_kernel"] = writer.kernel
                if n == 4096:
                    row[f"matmuls_beside_8_writer_{word}_ms"] = beside(
                        matmuls, lambda: writer.write(hidden, meta, first, capacity), side)
            if n == 4096:
                row["matmuls_beside_8_copy_engine_ms"] = beside(
                    matmuls, lambda: pinned.copy_(hidden, non_blocking=True), side)
            results[f"{name}-{n}"] = row
            print(name, json.dumps(row), flush=True)
        registered.keep_only(set())
    out = {"meta": {"commit": provenance.commit(), "command": "python -m experiments.gpu.writer_words",
                    "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}, "results": results}
    (args.out / "writer_words.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
