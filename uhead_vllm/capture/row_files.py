"""A shared row file: its layout and its mapping as a :class:`~.destination.RowDestination`.

The engine side creates the file (sparse: pages appear as the worker writes them) and maps it; the
worker maps the same file from its plain description (:class:`~.protocol.SharedDestination`), so
rows reach the engine side without being serialised (written while vLLM generates, or at a take by
tag: :func:`rows_into_file`). The file holds the rows, then (aligned) one
int32 token mark per row, each with one scratch place after the last: a writer on the device sends
rows it must not keep (past a slot, of no slot) there instead of branching on the host
(file_writer.py).
"""

from __future__ import annotations

import os
import secrets

import torch

from .destination import RowDestination
from .protocol import DTYPES, CapturedRows, SharedDestination

#: Alignment of the token marks after the rows in a shared row file.
_TOKENS_ALIGN = 64


def destination_nbytes(shape: tuple[int, int, int], dtype: str) -> int:
    """Bytes of a shared row file holding rows of ``shape`` in ``dtype`` (its name)
    and their token marks, each with one scratch place after the last (see :func:`file_views`)."""
    return _aligned(_rows_nbytes(_with_scratch(shape), dtype)) + 4 * (shape[0] + 1)


def file_views(flat: torch.Tensor, shape: tuple[int, int, int], dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a shared row file as ``[rows + 1, bytes per row]`` uint8 and its token marks
    as ``[rows + 1]`` int32, over ``flat`` (a uint8 mapping of the file, host or device-visible).
    The last place of each is scratch."""
    rows, layers, hidden = shape
    nbytes = _rows_nbytes(_with_scratch(shape), dtype)
    at = _aligned(nbytes)
    byte_rows = flat[:nbytes].view(rows + 1, layers * hidden * DTYPES[dtype].itemsize)
    return byte_rows, flat[at : at + 4 * (rows + 1)].view(torch.int32)


def file_key(owner: str) -> str:
    """A new file's key, ``owner.file``: unique for the file's life, and naming the engine side
    that made it (:func:`key_owner`)."""
    return f"{owner}.{secrets.token_hex(8)}"


def key_owner(key: str) -> str:
    """The engine side that made a file, from the file's key (``owner.file``): each process that
    maps row files (an API server of several on one engine) prunes only its own."""
    return key.split(".", 1)[0]


def open_destination(spec: SharedDestination, mapped: dict[str, torch.Tensor] | None = None) -> RowDestination:
    """Map the engine side's file as the destination buffer; with ``mapped`` (the worker's
    mappings by key, kept across calls) reuse this file's mapping and unmap the files the
    engine side let go of: the files of the spec's owner (:func:`key_owner`) that ``keep`` no
    longer lists, so that the files of other API server processes on the same engine stay
    mapped. Raises ``FileNotFoundError`` unless this is that very file (same device and inode):
    a worker on another host must never write rows into a file of its own that the engine side
    cannot see."""
    if mapped is not None and spec.key:
        owner = key_owner(spec.key)
        for gone in {k for k in mapped if key_owner(k) == owner} - set(spec.keep):
            del mapped[gone]
    flat = mapped.get(spec.key) if mapped is not None and spec.key else None
    if flat is None:
        try:
            st = os.stat(spec.path)
        except OSError as exc:
            raise FileNotFoundError(f"shared row buffer {spec.path} is not visible here") from exc
        if (st.st_dev, st.st_ino) != tuple(spec.file_id):
            raise FileNotFoundError(f"{spec.path} here is not the engine side's shared row buffer")
        nbytes = destination_nbytes(spec.shape, spec.dtype)
        flat = torch.from_file(spec.path, shared=True, size=max(spec.file_bytes, nbytes), dtype=torch.uint8)
        if mapped is not None and spec.key:
            mapped[spec.key] = flat
    return destination_on(spec, flat)


def destination_on(spec: SharedDestination, flat: torch.Tensor, tables: bool = True) -> RowDestination:
    """The destination over ``flat``, a uint8 mapping of the file (either side's); ``tables``:
    the placer's group tables (the worker's side needs them, the engine side does not)."""
    nbytes = destination_nbytes(spec.shape, spec.dtype)
    if flat.numel() < nbytes:
        raise ValueError(f"shared row file {spec.key or spec.path} holds {flat.numel()} bytes, "
                         f"the destination needs {nbytes}")
    byte_rows, marks = file_views(flat, spec.shape, spec.dtype)
    rows = spec.shape[0]
    buffer = byte_rows[:rows].view(DTYPES[spec.dtype]).view(spec.shape)
    return RowDestination(buffer, dict(spec.slots), list(spec.groups), marks[:rows], dict(spec.starts), tables=tables)


def rows_into_file(rows: CapturedRows, spec: SharedDestination, mapped: dict[str, torch.Tensor]) -> CapturedRows:
    """Write ``rows``' hidden rows into the first rows of the engine side's file ``spec`` and leave
    them out of ``rows`` (``stats["rows_in_file"]`` says how many): the rows cross through shared
    memory, only their metadata as bytes. ``rows`` unchanged when they do not fit the file's shape
    or the file is not visible here (another host)."""
    n = rows.num_rows
    if not n or rows.placed:
        return rows
    first = rows.hidden_parts[0]
    if n > spec.shape[0] or tuple(first.shape[1:]) != spec.shape[1:] or first.dtype != DTYPES[spec.dtype]:
        return rows
    try:
        buffer = open_destination(spec, mapped).buffer
    except FileNotFoundError:
        return rows
    torch.cat(rows.hidden_parts, out=buffer[:n])  # one call however many parts (a tag take: one per step)
    rows.hidden_parts = [first[:0]]
    rows.stats = {**rows.stats, "rows_in_file": n}
    return rows


def _with_scratch(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    return (shape[0] + 1, shape[1], shape[2])


def _rows_nbytes(shape: tuple[int, int, int], dtype: str) -> int:
    rows, layers, hidden = shape
    return rows * layers * hidden * DTYPES[dtype].itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _TOKENS_ALIGN) * _TOKENS_ALIGN
