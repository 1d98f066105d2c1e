"""Where the worker writes a generation's rows: a host buffer, its token marks and its slots.

The engine side passes a :class:`RowDestination` itself when the worker runs in its process; across
processes it describes a shared-memory file (:class:`~.protocol.SharedDestination`) that the
worker maps as one (row_files.py).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import numpy as np
import torch

from .group_tables import GroupTables

#: A destination's token mark where no row was written.
UNWRITTEN = -1


def shared_mark(tokens: np.ndarray) -> np.ndarray:
    """The token mark of rows another member of a prefix group wrote: ``-2 - token`` (never
    :data:`UNWRITTEN`, never a token id)."""
    return -2 - tokens


@dataclass
class RowDestination(GroupTables):
    """Rows of the coming generation, written while the engine still generates.

    Each request tag owns ``slots[tag] = (first row, capacity)`` of ``buffer`` and its row at
    position p goes to ``buffer[first + p]`` (positions at or past the capacity are not written).
    The caller allocates the buffer for the longest each sequence can get (prompt + max_tokens):
    pages never written are never touched, so the unused tail costs address space, not memory
    (a shared file handed out again keeps the pages earlier calls touched).
    With each row the worker writes its input token into ``tokens`` (the place's mark: the token,
    ``shared_mark(token)`` for a row a group member wrote, :data:`UNWRITTEN` where no row came),
    so the engine side checks every row against the sequence's token there without any per-row
    metadata coming back (:class:`~.protocol.CapturedRows` with ``placed=True`` is just a count).
    The engine side resets the marks before each generation.

    ``groups`` are ``(limit, tags)``: requests whose prompts agree on their first ``limit`` tokens
    (the samples of one prompt; prompts sharing a chat template's blocks), a laminar family (see
    group_tables.py). vLLM forwards such a prefix for one request and serves it to the others
    from its prefix cache; so a row a member forwards at a position below the limit of the deepest
    group it shares with another member is also written into that member's slot, during the
    generation instead of as block copies after; never below that member's capture window
    (``starts[tag]``: the first position whose row the request wants; its own rows below it are
    never recorded either).
    """

    buffer: torch.Tensor  # [total capacity, L, H] on the host
    slots: dict[int, tuple[int, int]]
    groups: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    tokens: torch.Tensor | None = None  # [total capacity] int32 marks (None: new, all UNWRITTEN)
    starts: dict[int, int] = field(default_factory=dict)  # tag -> its capture window's start (absent: 0)
    byte_rows: np.ndarray = field(init=False, repr=False)  # the buffer as [rows, bytes per row] uint8
    marks: np.ndarray = field(init=False, repr=False)  # ``tokens`` as numpy
    tables: InitVar[bool] = True  # False: the engine side's view of a shared file, never written through

    def __post_init__(self, tables: bool) -> None:
        if self.buffer.device.type != "cpu" or self.buffer.dim() != 3 or not self.buffer.is_contiguous():
            raise ValueError("RowDestination.buffer must be a contiguous [rows, layers, hidden] host tensor")
        self.byte_rows = self.buffer.view(torch.uint8).numpy().reshape(self.buffer.shape[0], -1)
        if self.tokens is None:
            self.tokens = torch.full((self.buffer.shape[0],), UNWRITTEN, dtype=torch.int32)
        if self.tokens.dtype != torch.int32 or self.tokens.shape != self.buffer.shape[:1]:
            raise ValueError("RowDestination.tokens must be int32 with one mark per buffer row")
        self.marks = self.tokens.numpy()
        end = max((a + n for a, n in self.slots.values()), default=0)
        if end > self.buffer.shape[0] or any(a < 0 or n < 0 for a, n in self.slots.values()):
            raise ValueError(f"RowDestination slots reach row {end}; the buffer has {self.buffer.shape[0]}")
        if tables:
            self.build_group_tables(self.slots, self.groups, self.starts)
