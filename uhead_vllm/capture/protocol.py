"""The one typed interface between the worker side (inside vLLM) and the engine side.

Everything that crosses the boundary is plain data: a JSON string for settings, a small dict in
``SamplingParams.extra_args`` for request tags, and safetensors bytes for captured rows. Nothing is
ever pickled, so a payload from another process can be decoded safely.
"""

from __future__ import annotations

import json
import os
from dataclasses import InitVar, dataclass, field

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .points import Site, parse_sites

#: Key used in ``LLM(additional_config=...)`` and in ``SamplingParams.extra_args``.
CAPTURE_KEY = "uhead_vllm"
#: Qualified name passed to ``LLM(worker_extension_cls=...)``.
EXTENSION_QUALNAME = "uhead_vllm.capture.extension.UheadCaptureExtension"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: A destination's token mark where no row was written (see :class:`RowDestination`).
UNWRITTEN = -1
#: Alignment of the token marks after the rows in a shared row file.
_TOKENS_ALIGN = 64


def shared_mark(tokens: np.ndarray) -> np.ndarray:
    """The token mark of rows another member of a prefix group wrote: ``-2 - token`` (never
    :data:`UNWRITTEN`, never a token id)."""
    return -2 - tokens


@dataclass(frozen=True)
class CaptureSettings:
    """What the worker records: HF ``output_hidden_states`` layer indices, storage dtype, budget;
    optionally points inside decoder layers and whether requests may steer.

    Layer k is the residual stream after decoder layer k-1 (0 = embeddings, the last index is the
    stream *before* the final norm). ``points`` are ``(point, decoder layer)`` sites (see
    :mod:`.points`); rows hold ``len(layers) + len(points)`` columns, the layers first. Points and
    steering are read / applied by hooks, so they need an eager engine.
    """

    layers: tuple[int, ...]
    dtype: str = "float32"
    max_bytes: int = 4 << 30
    points: tuple[Site, ...] = ()
    steering: bool = False

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("CaptureSettings.layers is empty: name at least one layer")
        if any((not isinstance(k, int)) or k < 0 for k in self.layers):
            raise ValueError(f"layers must be non-negative ints (HF indexing), got {self.layers}")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers contain duplicates: {self.layers}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        object.__setattr__(self, "points", parse_sites(self.points))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def num_columns(self) -> int:
        """Columns per captured row: the layers, then the points."""
        return len(self.layers) + len(self.points)

    @property
    def needs_hooks(self) -> bool:
        """True when the engine must run eagerly (points or steering are hooks on submodules)."""
        return bool(self.points) or self.steering

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "dtype": self.dtype, "max_bytes": self.max_bytes,
                "points": [list(s) for s in self.points], "steering": self.steering}

    @classmethod
    def from_dict(cls, d: dict) -> "CaptureSettings":
        return cls(layers=tuple(int(k) for k in d["layers"]), dtype=d.get("dtype", "float32"),
                   max_bytes=int(d.get("max_bytes", 4 << 30)),
                   points=tuple((str(p), int(k)) for p, k in d.get("points", ())),
                   steering=bool(d.get("steering", False)))


@dataclass(frozen=True)
class RequestTag:
    """Explicit identity of one sequence: the caller's tag and the sample index within its prompt."""

    tag: int
    sample: int = 0

    def to_extra_args(self) -> dict:
        return {CAPTURE_KEY: {"tag": self.tag, "sample": self.sample}}

    @classmethod
    def from_extra_args(cls, extra_args: dict | None) -> "RequestTag | None":
        if not extra_args or CAPTURE_KEY not in extra_args:
            return None
        d = extra_args[CAPTURE_KEY]
        return cls(tag=int(d["tag"]), sample=int(d.get("sample", 0)))


@dataclass
class CapturedRows:
    """All rows of one fetch. Row r belongs to (tags[r], samples[r]) at positions[r], where the
    forwarded input token was token_ids[r]; hidden[r] is [num_layers, hidden_size].
    ``chunk_offsets`` delimit the contiguous chunks as scheduled (one per request per forward), so
    chunked prefill and prefix-cache skips stay visible.

    The rows may arrive as several consecutive parts (one per recorded step, handed over in
    process without concatenating them: on a GPU each part is the pinned buffer its step was
    copied into); ``hidden`` concatenates them once, on first use, and ``hidden_parts`` yields
    them as they are, for a consumer that can place rows part by part without that extra copy.
    ``placed`` rows were written into the caller's :class:`RowDestination` during the generation
    instead: then there are no hidden parts and no per-row metadata (the destination's token marks
    say which rows were written), only their count, ``placed_rows``.
    """

    layers: tuple[int, ...]
    hidden_parts: list[torch.Tensor] | torch.Tensor  # consecutive [R_i, L, H] parts (a tensor = one part)
    tags: torch.Tensor  # [R] int64
    samples: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64
    token_ids: torch.Tensor  # [R] int64
    chunk_offsets: torch.Tensor  # [C + 1] int64
    error: str | None = None
    stats: dict = field(default_factory=dict)
    placed: bool = False
    placed_rows: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.hidden_parts, torch.Tensor):
            self.hidden_parts = [self.hidden_parts]
        if not self.hidden_parts and not self.placed:
            raise ValueError("CapturedRows needs at least one (possibly empty) hidden part")

    @property
    def hidden(self) -> torch.Tensor:
        """All rows ``[R, L, H]`` in one tensor (concatenated once, then kept)."""
        if self.placed:
            raise ValueError("these rows were placed into the caller's RowDestination, not handed over")
        if len(self.hidden_parts) > 1:
            self.hidden_parts = [torch.cat(self.hidden_parts)]
        return self.hidden_parts[0]

    @property
    def num_rows(self) -> int:
        return self.placed_rows if self.placed else int(self.tags.numel())

    @classmethod
    def placed_into_destination(cls, layers: tuple[int, ...], count: int) -> "CapturedRows":
        """``count`` rows written into the caller's :class:`RowDestination` (nothing else to hand over)."""
        z = torch.zeros(0, dtype=torch.int64)
        return cls(layers=layers, hidden_parts=[], tags=z, samples=z, positions=z, token_ids=z,
                   chunk_offsets=torch.zeros(1, dtype=torch.int64), placed=True, placed_rows=count)

    def chunks(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(tag, sample, positions, token_ids, hidden) per scheduled chunk."""
        out = []
        offs = self.chunk_offsets.tolist()
        for a, b in zip(offs[:-1], offs[1:]):
            out.append((int(self.tags[a]), int(self.samples[a]), self.positions[a:b],
                        self.token_ids[a:b], self.hidden[a:b]))
        return out


@dataclass
class RowDestination:
    """Where the worker writes rows during a generation: a tensor of the caller's process when the
    engine core runs there, else a mapping of a shared-memory file (:class:`SharedDestination`).

    Each request tag owns ``slots[tag] = (first row, capacity)`` of ``buffer`` and its row at
    position p goes to ``buffer[first + p]`` (positions at or past the capacity are not written).
    The caller allocates the buffer for the longest each sequence can get (prompt + max_tokens):
    pages never written are never touched, so the unused tail costs address space, not memory
    (a shared file handed out again keeps the pages earlier calls touched).
    Rows then reach their final place while the engine still generates, instead of in one copy
    after it. With each row the worker writes its input token into ``tokens`` (the place's mark:
    the token, ``shared_mark(token)`` for a row a group member wrote, :data:`UNWRITTEN` where no
    row came), so the engine side checks every row against the sequence's token there without any
    per-row metadata coming back (:class:`CapturedRows` with ``placed=True`` is just a count). The
    engine side resets the marks before each generation.

    ``groups`` are ``(limit, tags)``: requests whose prompts agree on their first ``limit`` tokens
    (the samples of one prompt; prompts sharing a chat template's blocks), a laminar family (two
    groups are nested or disjoint, the smaller one with the longer limit). vLLM forwards such a
    prefix for one request and serves it to the others from its prefix cache; so a row a member
    forwards at a position below the limit of the deepest group it shares with another member is
    also written into that member's slot, during the generation instead of as block copies after.
    """

    buffer: torch.Tensor  # [total capacity, L, H] on the host
    slots: dict[int, tuple[int, int]]
    groups: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    tokens: torch.Tensor | None = None  # [total capacity] int32 marks (None: new, all UNWRITTEN)
    byte_rows: np.ndarray = field(init=False, repr=False)  # the buffer as [rows, bytes per row] uint8
    marks: np.ndarray = field(init=False, repr=False)  # ``tokens`` as numpy
    # The groups as nested member ranges (each group's members are contiguous in ``member_first``,
    # the slots' first rows in that order): per grouped tag (row ``group_row[tag]``; the last row:
    # no group) its groups outer to inner with their limits (-1 / int64 max padding) and its own
    # index in ``member_first``. Sizes grow with tags x nesting depth, never tags x group size,
    # so one group of thousands of requests (a shared system prompt) stays cheap.
    group_row: dict[int, int] = field(init=False, repr=False)
    chain: np.ndarray = field(init=False, repr=False)  # [T + 1, D] group ids
    chain_limit: np.ndarray = field(init=False, repr=False)  # [T + 1, D]
    reach: np.ndarray = field(init=False, repr=False)  # [T + 1] limit of the deepest group (0: none)
    member_index: np.ndarray = field(init=False, repr=False)  # [T + 1]
    member_first: np.ndarray = field(init=False, repr=False)  # [T]
    group_span: np.ndarray = field(init=False, repr=False)  # [G, 2] member range of each group
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
            self._build_group_tables()

    def _build_group_tables(self) -> None:
        """The worker's lookup tables for ``groups`` (see the fields above)."""
        ordered = sorted(self.groups, key=lambda g: (g[0], -len(g[1])))  # outer (shorter limit, larger) first
        chains: dict[int, list[int]] = {}
        for g, (limit, tags) in enumerate(ordered):
            if any(t not in self.slots or self.slots[t][1] < limit for t in tags):
                raise ValueError(f"prefix group {tags}: every member needs a slot of at least {limit} rows")
            parents = {chains[t][-1] if t in chains else -1 for t in tags}  # the group around each member
            parent = parents.pop() if len(parents) == 1 else None
            twice = parent is not None and parent >= 0 and len(ordered[parent][1]) == len(tags)
            if len(set(tags)) != len(tags) or parent is None or twice:
                raise ValueError(f"prefix group {tags}: groups must be nested or disjoint, an inner group's "
                                 "limit at least that of the group around it")
            for t in tags:
                chains.setdefault(t, []).append(g)
        members = sorted(chains, key=lambda t: chains[t])  # every group's members become contiguous
        depth = max((len(c) for c in chains.values()), default=0)
        self.group_row = {t: k for k, t in enumerate(members)}
        self.chain = np.full((len(members) + 1, depth), -1, dtype=np.int64)
        self.chain_limit = np.full((len(members) + 1, depth), np.iinfo(np.int64).max, dtype=np.int64)
        for k, t in enumerate(members):
            self.chain[k, : len(chains[t])] = chains[t]
            self.chain_limit[k, : len(chains[t])] = [ordered[g][0] for g in chains[t]]
        self.reach = np.asarray([ordered[chains[t][-1]][0] for t in members] + [0], dtype=np.int64)
        self.member_index = np.arange(len(members) + 1, dtype=np.int64)
        self.member_index[-1] = -1
        self.member_first = np.asarray([self.slots[t][0] for t in members], dtype=np.int64)
        self.group_span = np.zeros((len(ordered), 2), dtype=np.int64)
        for g, (_, tags) in enumerate(ordered):
            at = sorted(self.group_row[t] for t in tags)
            self.group_span[g] = (at[0], at[-1] + 1)


@dataclass(frozen=True)
class SharedDestination:
    """A :class:`RowDestination` in a shared-memory file, for a worker in another process.

    The engine side creates the file (sparse: pages appear as the worker writes them) and maps it;
    this plain description crosses the process boundary as JSON and the worker maps the same
    file, so rows reach the engine side without being serialised. The engine side hands a file
    out again once nobody holds its rows (``generation/shared_rows.py``): the worker keeps its
    mapping under ``key`` while the key is among ``keep``, so a reused file's pages are neither
    mapped nor allocated again.
    """

    path: str
    shape: tuple[int, int, int]  # [total capacity, L, H]
    dtype: str
    slots: dict[int, tuple[int, int]]
    file_id: tuple[int, int] = (0, 0)  # (device, inode) of the file: a worker on another host has none
    groups: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # see RowDestination
    key: str = ""  # the file's own name for the worker's mapping ("": map it for this call only)
    file_bytes: int = 0  # the file's size (0: just the buffer)
    keep: tuple[str, ...] = ()  # keys of every file the engine side still maps
    device_writes: bool | None = None  # the engine side's choice of who writes rows (None: the worker's)

    def to_json(self) -> str:
        return json.dumps({"path": self.path, "shape": list(self.shape), "dtype": self.dtype,
                           "slots": {str(t): list(s) for t, s in self.slots.items()},
                           "file_id": list(self.file_id),
                           "groups": [[limit, list(tags)] for limit, tags in self.groups],
                           "key": self.key, "file_bytes": self.file_bytes, "keep": list(self.keep),
                           "device_writes": self.device_writes})

    @classmethod
    def from_json(cls, text: str) -> "SharedDestination":
        d = json.loads(text)
        if d.get("dtype") not in _DTYPES or len(d.get("shape", ())) != 3:
            raise ValueError(f"not a shared row destination: {text[:200]!r}")
        return cls(str(d["path"]), tuple(int(x) for x in d["shape"]), d["dtype"],
                   {int(t): (int(a), int(n)) for t, (a, n) in d["slots"].items()},
                   tuple(int(x) for x in d.get("file_id", (0, 0))),
                   [(int(limit), tuple(int(t) for t in tags)) for limit, tags in d.get("groups", ())],
                   str(d.get("key", "")), int(d.get("file_bytes", 0)), tuple(str(k) for k in d.get("keep", ())),
                   None if d.get("device_writes") is None else bool(d["device_writes"]))

    @property
    def nbytes(self) -> int:
        """Bytes of the file the destination uses: the rows, then one int32 token mark per row."""
        return destination_nbytes(self.shape, self.dtype)

    def open(self, mapped: dict[str, torch.Tensor] | None = None) -> RowDestination:
        """Map the engine side's file as the destination buffer; with ``mapped`` (the worker's
        mappings by key, kept across calls) reuse this file's mapping and unmap the files the
        engine side let go of. Raises ``FileNotFoundError`` unless this is that very file (same
        device and inode): a worker on another host must never write rows into a file of its
        own that the engine side cannot see."""
        if mapped is not None:
            for gone in set(mapped) - set(self.keep):
                del mapped[gone]
        flat = mapped.get(self.key) if mapped is not None and self.key else None
        if flat is None:
            try:
                st = os.stat(self.path)
            except OSError as exc:
                raise FileNotFoundError(f"shared row buffer {self.path} is not visible here") from exc
            if (st.st_dev, st.st_ino) != tuple(self.file_id):
                raise FileNotFoundError(f"{self.path} here is not the engine side's shared row buffer")
            flat = torch.from_file(self.path, shared=True, size=max(self.file_bytes, self.nbytes), dtype=torch.uint8)
            if mapped is not None and self.key:
                mapped[self.key] = flat
        return self.on(flat)

    def on(self, flat: torch.Tensor, tables: bool = True) -> RowDestination:
        """The destination over ``flat``, a uint8 mapping of the file (either side's); ``tables``:
        the placer's group tables (the worker's side needs them, the engine side does not)."""
        if flat.numel() < self.nbytes:
            raise ValueError(f"shared row file {self.key or self.path} holds {flat.numel()} bytes, "
                             f"the destination needs {self.nbytes}")
        byte_rows, marks = file_views(flat, self.shape, self.dtype)
        rows = self.shape[0]
        buffer = byte_rows[:rows].view(_DTYPES[self.dtype]).view(self.shape)
        return RowDestination(buffer, dict(self.slots), list(self.groups), marks[:rows], tables=tables)


def destination_nbytes(shape: tuple[int, int, int], dtype: str) -> int:
    """Bytes of a shared row file holding rows of ``shape`` in ``dtype`` and their token marks,
    each with one scratch place after the last (see :func:`file_views`)."""
    return _aligned(_rows_nbytes(_with_scratch(shape), dtype)) + 4 * (shape[0] + 1)


def file_views(flat: torch.Tensor, shape: tuple[int, int, int], dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a shared row file as ``[rows + 1, bytes per row]`` uint8 and its token marks
    as ``[rows + 1]`` int32, over ``flat`` (a uint8 mapping of the file, host or device-visible).
    The last place of each is scratch: a writer on the device sends rows it must not keep (past
    a slot, of no slot) there instead of branching on the host (capture/file_writer.py)."""
    rows, layers, hidden = shape
    nbytes = _rows_nbytes(_with_scratch(shape), dtype)
    at = _aligned(nbytes)
    byte_rows = flat[:nbytes].view(rows + 1, layers * hidden * _DTYPES[dtype].itemsize)
    return byte_rows, flat[at : at + 4 * (rows + 1)].view(torch.int32)


def _with_scratch(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    return (shape[0] + 1, shape[1], shape[2])


def _rows_nbytes(shape: tuple[int, int, int], dtype: str) -> int:
    rows, layers, hidden = shape
    return rows * layers * hidden * _DTYPES[dtype].itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _TOKENS_ALIGN) * _TOKENS_ALIGN


def encode_rows(rows: CapturedRows) -> bytes:
    """Serialize to safetensors bytes (metadata carries layers, error and worker stats as JSON).
    Placed rows are a count: the rows and their token marks are already in the shared file."""
    meta = {"layers": json.dumps(list(rows.layers)), "stats": json.dumps(rows.stats)}
    if rows.error:
        meta["error"] = rows.error
    if rows.placed:
        meta["placed"] = str(rows.placed_rows)
    tensors = {
        "tags": rows.tags, "samples": rows.samples, "positions": rows.positions,
        "token_ids": rows.token_ids, "chunk_offsets": rows.chunk_offsets,
    }
    if not rows.placed:
        tensors["hidden"] = rows.hidden.contiguous()
    return st_save(tensors, metadata=meta)


def decode_rows(payload: bytes) -> CapturedRows:
    """Inverse of :func:`encode_rows`; safetensors parsing never executes code."""
    if not isinstance(payload, (bytes, bytearray)):
        raise TypeError(f"capture payload must be bytes, got {type(payload).__name__}")
    t = st_load(bytes(payload))
    meta = _read_metadata(bytes(payload))
    return CapturedRows(
        layers=tuple(json.loads(meta["layers"])), hidden_parts=[t["hidden"]] if "hidden" in t else [],
        placed="placed" in meta, placed_rows=int(meta.get("placed", 0)), tags=t["tags"],
        samples=t["samples"], positions=t["positions"], token_ids=t["token_ids"],
        chunk_offsets=t["chunk_offsets"], error=meta.get("error"),
        stats=json.loads(meta.get("stats", "{}")),
    )


def _read_metadata(payload: bytes) -> dict:
    n = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + n])
    return header.get("__metadata__", {}) or {}


def settings_to_json(settings: CaptureSettings) -> str:
    return json.dumps(settings.to_dict())


def empty_rows(layers: tuple[int, ...], hidden_size: int, dtype: torch.dtype, columns: int | None = None
               ) -> CapturedRows:
    """No rows; ``columns`` defaults to one per layer (more when points are captured)."""
    z = torch.zeros(0, dtype=torch.int64)
    width = len(layers) if columns is None else columns
    return CapturedRows(layers=layers, hidden_parts=torch.empty(0, width, hidden_size, dtype=dtype),
                        tags=z, samples=z.clone(), positions=z.clone(), token_ids=z.clone(),
                        chunk_offsets=torch.zeros(1, dtype=torch.int64))


__all__ = [
    "CAPTURE_KEY", "EXTENSION_QUALNAME", "UNWRITTEN", "CaptureSettings", "RequestTag", "CapturedRows", "RowDestination",
    "SharedDestination", "destination_nbytes", "file_views", "shared_mark", "encode_rows", "decode_rows", "settings_to_json", "empty_rows",
]
