"""The file writer's scatter as one Triton kernel on a few of the GPU's SMs.

Writing a flush into the registered row file is PCIe-bound: an 8B model's 4,096 rows (100 MB) take
~2.3 ms however they are written. ``index_copy_`` spreads that over every SM, and each of its
blocks holds its SM while its stores wait on PCIe, so a GPU-bound forward beside it lost 13-16 ms
per call to 8 flushes where the copy engine's copies of the same bytes cost 2 ms (docs/gpu.md,
session 22). Here a fixed grid of :data:`PROGRAMS` programs walks the rows (row ``r`` by program
``r mod PROGRAMS``), each copying whole rows word by word and writing the row's token mark: the
rest of the GPU stays with the model, and the rows and marks are one launch instead of two.

Needs Triton (vLLM's CUDA builds bring it); without it, or on a CPU, the writer keeps torch's
``index_copy_``. ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (no Triton, or one that cannot load here: index_copy_ then)
    triton = None

#: Programs (each on one SM) the scatter runs as; a measuring aid overrides it per call.
PROGRAMS = 16
#: Words each program moves per inner step (8 KB of 8-byte words).
BLOCK_WORDS = 1024


def available(device: torch.device) -> bool:
    """Whether :func:`scatter_rows` can run for tensors on ``device``."""
    return triton is not None and device.type == "cuda"


if triton is not None:
    @triton.jit(do_not_specialize=["n_rows", "tokens", "marks"])  # one compile per row width
    def _scatter(src, dst, index, tokens, marks, n_rows, src_stride, dst_stride, WORDS: tl.constexpr,
                 BLOCK: tl.constexpr):
        program, programs = tl.program_id(0), tl.num_programs(0)
        for r in range(program, n_rows, programs):
            place = tl.load(index + r)  # int64: a file's words can outnumber int32
            source = src + r * src_stride  # a flush's words do not
            target = dst + place * dst_stride
            for w in range(0, WORDS, BLOCK):
                offsets = w + tl.arange(0, BLOCK)
                inside = offsets < WORDS
                tl.store(target + offsets, tl.load(source + offsets, mask=inside), mask=inside)
            tl.store(marks + place, tl.load(tokens + r).to(tl.int32))


def scatter_rows(rows: torch.Tensor, index: torch.Tensor, src: torch.Tensor, marks: torch.Tensor,
                 tokens: torch.Tensor, programs: int = PROGRAMS) -> None:
    """``rows[index[r]] = src[r]`` and ``marks[index[r]] = tokens[r]`` for every row ``r``, on the
    current stream. ``rows`` [N, W] and ``src`` [R, W] are words of one integer type with
    contiguous rows; ``index`` [R] int64 holds places with no duplicates among rows that matter
    (a duplicate's rows are written in no set order)."""
    n, words = src.shape
    if n == 0:
        return
    if rows.dtype != src.dtype or rows.shape[1] != words or rows.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype} and source {tuple(src.shape)} {src.dtype} "
                         "must be rows of the same words")
    block = min(BLOCK_WORDS, triton.next_power_of_2(words))
    _scatter[(min(programs, n),)](src, rows, index, tokens, marks, n, src.stride(0), rows.stride(0),
                                  WORDS=words, BLOCK=block)
