"""The file writer's scatter as two Triton kernels: the places, then the rows on a few SMs.

Writing a flush into the registered row file is PCIe-bound: an 8B model's 4,096 rows (100 MB) take
~2.3 ms however they are written. ``index_copy_`` spreads that over every SM, and each of its
blocks holds its SM while its stores wait on PCIe: beside a GPU-bound chain of matmuls, 8 such
flushes cost it 12 ms more, the copy engine's copies of the same bytes 1 ms, and a kernel on 4-8
programs 2.5-3.2 ms (H100, ``experiments/gpu/writer_words.py``,
``experiments/results/gpu/scatter-kernel-2444044-h100/``). And the torch way took a dozen launches
per flush on the engine's thread (places, the last row per place, two copies), which at the 8B
shape's 64 flushes a call cost more than the placer it replaces (the same results).

So a flush is two launches. :func:`_claim` computes each row's place, ``first + position`` inside
its slot, and claims the place with an atomic max of ``stamp + row``: the last row bound for a place
(a position forwarded again) wins, and a stamp that grows per flush makes the table need no reset.
:func:`_scatter` then has :data:`PROGRAMS` programs walk tiles of rows, copying the rows that hold
their claim (and their token marks) word by word. Rows of no slot, past it, or outclaimed are not
written.

Needs Triton (vLLM's CUDA builds bring it); without it, or on a CPU, the writer keeps torch's ops.
``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (no Triton, or one that cannot load here: torch's ops then)
    triton = None

#: Programs (each on one SM) the row copy runs as: 4-8 moved 8B rows as fast as the whole GPU and
#: left a matmul chain beside them 4-5% slower, 16 12%, 132 (every SM) 18% (writer_words, H100).
PROGRAMS = 8
#: Elements (8-byte words) one program moves per inner step, over a tile of rows.
TILE_WORDS = 4096
#: Rows whose places one program of the claim computes.
CLAIM_ROWS = 1024
#: A flush's stamp is its number times this, plus the row: rows per flush stay below it.
STAMP = 1 << 32


def available(device: torch.device) -> bool:
    """Whether :func:`scatter_rows` can run for tensors on ``device``."""
    return triton is not None and device.type == "cuda"


if triton is not None:
    # Arguments whose values or alignment change from flush to flush or file to file are not
    # specialised on: one compile per row width (warm_up's), none in the middle of a generation.
    # (``capacity`` is the second row of the flush's [2, R] slot facts: 16-byte aligned for even R.)
    @triton.jit(do_not_specialize=["positions", "first", "capacity", "n_rows", "stamp", "scratch"])
    def _claim(positions, first, capacity, places, last, n_rows, stamp, scratch, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        real = rows < n_rows
        pos = tl.load(positions + rows, mask=real, other=-1)
        start = tl.load(first + rows, mask=real, other=-1)
        inside = real & (pos >= 0) & (pos < tl.load(capacity + rows, mask=real, other=0))
        place = tl.where(inside, start + pos, scratch)
        tl.store(places + rows, place, mask=real)
        tl.atomic_max(last + place, stamp + rows, mask=inside)

    @triton.jit(do_not_specialize=["tokens", "marks", "n_rows", "stamp", "scratch"])
    def _scatter(src, dst, places, last, tokens, marks, n_rows, stamp, scratch, src_stride, dst_stride,
                 WORDS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        program, programs = tl.program_id(0), tl.num_programs(0)
        for tile in range(program, (n_rows + ROWS - 1) // ROWS, programs):
            rows = tile * ROWS + tl.arange(0, ROWS)
            place = tl.load(places + rows, mask=rows < n_rows, other=scratch)
            owns = (place != scratch) & (tl.load(last + place) == stamp + rows)
            tl.store(marks + place, tl.load(tokens + rows, mask=owns).to(tl.int32), mask=owns)
            source = src + rows[:, None] * src_stride
            target = dst + place[:, None] * dst_stride
            for w in range(0, WORDS, BLOCK):
                offsets = w + tl.arange(0, BLOCK)[None, :]
                copy = owns[:, None] & (offsets < WORDS)
                tl.store(target + offsets, tl.load(source + offsets, mask=copy), mask=copy)


def scatter_rows(rows: torch.Tensor, src: torch.Tensor, marks: torch.Tensor, positions: torch.Tensor,
                 tokens: torch.Tensor, first: torch.Tensor, capacity: torch.Tensor, last: torch.Tensor,
                 flush: int, programs: int = PROGRAMS) -> None:
    """Row ``r`` of ``src`` and its token into ``rows`` / ``marks`` at ``first[r] + positions[r]``
    when that is below ``capacity[r]`` and no later row of this call is bound there, on the current
    stream. ``rows`` [N + 1, W] (the last row is scratch) and ``src`` [R, W] are words of one integer
    type with contiguous rows; ``last`` [N + 1] int64 is the writer's claim table (zeros at first)
    and ``flush`` numbers this call among the writer's, from 1."""
    n, words = src.shape
    if n == 0:
        return
    if rows.dtype != src.dtype or rows.shape[1] != words or rows.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype} and source {tuple(src.shape)} {src.dtype} "
                         "must be rows of the same words")
    if n >= STAMP:
        raise ValueError(f"{n} rows in one flush: at most {STAMP - 1}")
    scratch, stamp = rows.shape[0] - 1, flush * STAMP
    places = torch.empty(n, dtype=torch.int64, device=src.device)
    _claim[(triton.cdiv(n, CLAIM_ROWS),)](positions, first, capacity, places, last, n, stamp, scratch,
                                          BLOCK=CLAIM_ROWS)
    block = min(triton.next_power_of_2(words), TILE_WORDS)
    _scatter[(min(programs, n),)](src, rows, places, last, tokens, marks, n, stamp, scratch, src.stride(0),
                                  rows.stride(0), WORDS=words, BLOCK=block, ROWS=max(1, TILE_WORDS // block))
