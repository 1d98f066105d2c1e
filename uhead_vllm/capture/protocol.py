"""The one typed interface between the worker side (inside vLLM) and the engine side: plain data. Settings travel
as JSON in ``additional_config``, request tags as a small dict in ``extra_args``, a shared row file as its JSON
description (row_files.py maps it), captured rows as safetensors bytes: nothing is ever pickled."""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from safetensors.torch import load as st_load, save as st_save

from .points import Site, parse_sites

CAPTURE_KEY = "uhead_vllm"  #: the key in ``LLM(additional_config=...)`` and ``SamplingParams.extra_args``
EXTENSION_QUALNAME = "uhead_vllm.capture.extension.UheadCaptureExtension"  #: ``LLM(worker_extension_cls=...)``
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  #: storage dtypes, by the names rows travel as


@dataclass(frozen=True)
class CaptureSettings:
    """What the worker records: HF ``output_hidden_states`` layer indices (k = the residual stream after decoder layer
    k-1, 0 = embeddings), storage dtype, budget; optionally ``(point, decoder layer)`` sites (:mod:`.points`, columns
    after the layers), whether requests may steer (both hooks) and ``token_inputs``, a head's weight file
    (heads/token_inputs.py): each row is then reduced on the device to the head's D inputs, one float32 column."""

    layers: tuple[int, ...]
    dtype: str = "float32"
    max_bytes: int = 4 << 30
    points: tuple[Site, ...] = ()
    steering: bool = False
    token_inputs: str = ""

    def __post_init__(self) -> None:
        if not (layers := self.layers) or any(not isinstance(k, int) or k < 0 for k in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"layers must be non-negative ints without duplicates (HF indices), got {layers}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        object.__setattr__(self, "points", parse_sites(self.points))
        if self.token_inputs and (self.points or self.dtype != "float32"):
            raise ValueError("token_inputs reduce the layers' rows to a head's float32 inputs: no points, dtype float32")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_columns(self) -> int:  # columns per captured row: the layers, then the points (token_inputs: one)
        return 1 if self.token_inputs else len(self.layers) + len(self.points)

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "dtype": self.dtype, "max_bytes": self.max_bytes,
                "points": [list(s) for s in self.points], "steering": self.steering, "token_inputs": self.token_inputs}

    @classmethod
    def from_dict(cls, d: dict) -> "CaptureSettings":
        return cls(layers=tuple(int(k) for k in d["layers"]), dtype=d.get("dtype", "float32"),
                   max_bytes=int(d.get("max_bytes", 4 << 30)), steering=bool(d.get("steering", False)),
                   points=tuple((str(p), int(k)) for p, k in d.get("points", ())), token_inputs=str(d.get("token_inputs", "")))


@dataclass(frozen=True)
class RequestTag:
    """Explicit identity of one sequence: the caller's tag, the sample index within its prompt, and
    its capture window's ``start``: the first position whose row is recorded (0: every row)."""

    tag: int
    sample: int = 0
    start: int = 0

    def to_extra_args(self) -> dict:
        d = {"tag": self.tag, "sample": self.sample}
        return {CAPTURE_KEY: {**d, "start": self.start} if self.start else d}

    @classmethod
    def from_extra_args(cls, extra_args: dict | None) -> "RequestTag | None":
        """The tag under :data:`CAPTURE_KEY` (None: none). ``ValueError`` for anything but a dict of
        integers ``tag``, ``sample`` and ``start`` (defaults 0) in [0, 2**63), the int64 they travel as."""
        if not extra_args or CAPTURE_KEY not in extra_args:
            return None
        d = extra_args[CAPTURE_KEY]
        values: tuple[Any, ...] = (d.get("tag"), d.get("sample", 0), d.get("start", 0)) if isinstance(d, dict) else (None,)
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and 0 <= cast(int, v) < 1 << 63 for v in values):
            raise ValueError(f"malformed capture tag under {CAPTURE_KEY!r}: {str(d)[:100]!r}")
        return cls(*(int(v) for v in values))


@dataclass
class CapturedRows:
    """All rows of one take: row r belongs to (tags[r], samples[r]) at positions[r], its input token
    was token_ids[r]; ``chunk_offsets`` delimit the chunks as scheduled (per request per forward).
    ``hidden_parts``: one part per step (in process: no copy), joined once by ``hidden``. ``placed``
    rows went into the caller's destination instead: only their count comes back."""

    layers: tuple[int, ...]
    hidden_parts: list[torch.Tensor] | torch.Tensor  # consecutive [R_i, L, H] parts (a tensor = one part)
    tags: torch.Tensor  # [R] int64, as samples, positions and token_ids
    samples: torch.Tensor
    positions: torch.Tensor
    token_ids: torch.Tensor
    chunk_offsets: torch.Tensor  # [C + 1] int64
    error: str | None = None
    stats: dict = field(default_factory=dict)
    placed: bool = False
    placed_rows: int = 0

    def __post_init__(self) -> None:
        self.hidden_parts = [self.hidden_parts] if isinstance(self.hidden_parts, torch.Tensor) else self.hidden_parts
        if not self.hidden_parts and not self.placed:
            raise ValueError("CapturedRows needs at least one (possibly empty) hidden part")

    @property
    def hidden(self) -> torch.Tensor:
        """All rows ``[R, L, H]`` in one tensor (concatenated once, then kept)."""
        if self.placed:
            raise ValueError("these rows were placed into the caller's RowDestination, not handed over")
        self.hidden_parts = [torch.cat(self.hidden_parts)] if len(self.hidden_parts) > 1 else self.hidden_parts
        return self.hidden_parts[0]

    @property
    def num_rows(self) -> int:
        return self.placed_rows if self.placed else int(self.tags.numel())

    @classmethod
    def placed_into_destination(cls, layers: tuple[int, ...], count: int) -> "CapturedRows":
        """``count`` rows written into the caller's destination (nothing else to hand over)."""
        z = torch.zeros(0, dtype=torch.int64)
        return cls(layers, [], z, z, z, z, torch.zeros(1, dtype=torch.int64), placed=True, placed_rows=count)

    def chunks(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(tag, sample, positions, token_ids, hidden) per scheduled chunk."""
        offs = self.chunk_offsets.tolist()
        return [(int(self.tags[a]), int(self.samples[a]), self.positions[a:b], self.token_ids[a:b], self.hidden[a:b])
                for a, b in zip(offs[:-1], offs[1:])]


@dataclass(frozen=True)
class SharedDestination:
    """A destination in a shared-memory file the engine side made, for a worker in another process;
    the worker keeps its mapping under ``key`` while ``keep`` lists it (files are handed out again)."""

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
    starts: dict[int, int] = field(default_factory=dict)  # tag -> its window's start (see RowDestination)

    def to_json(self) -> str:
        return json.dumps({**self.__dict__, "slots": {str(t): list(s) for t, s in self.slots.items()},
                           "starts": {str(t): s for t, s in self.starts.items()}})

    @classmethod
    def from_json(cls, text: str) -> "SharedDestination":
        d = json.loads(text)
        if d.get("dtype") not in DTYPES or len(d.get("shape", ())) != 3:
            raise ValueError(f"not a shared row destination: {text[:200]!r}")
        return cls(str(d["path"]), cast(tuple[int, int, int], tuple(int(x) for x in d["shape"])), d["dtype"],
                   {int(t): (int(a), int(n)) for t, (a, n) in d["slots"].items()},
                   cast(tuple[int, int], tuple(int(x) for x in d.get("file_id", (0, 0)))),
                   [(int(limit), tuple(int(t) for t in tags)) for limit, tags in d.get("groups", ())],
                   str(d.get("key", "")), int(d.get("file_bytes", 0)), tuple(str(k) for k in d.get("keep", ())),
                   None if (w := d.get("device_writes")) is None else bool(w),
                   {int(t): int(s) for t, s in d.get("starts", {}).items()})


def encode_rows(rows: CapturedRows) -> bytes:
    """Safetensors bytes, layers, error and stats as JSON metadata (placed rows: only their count)."""
    meta = {"layers": json.dumps(list(rows.layers)), "stats": json.dumps(rows.stats),
            **({"error": rows.error} if rows.error else {}), **({"placed": str(rows.placed_rows)} if rows.placed else {})}
    tensors = {"tags": rows.tags, "samples": rows.samples, "positions": rows.positions, "token_ids": rows.token_ids,
               "chunk_offsets": rows.chunk_offsets, **({} if rows.placed else {"hidden": rows.hidden.contiguous()})}
    return st_save(tensors, metadata=meta)


def decode_rows(payload: bytes) -> CapturedRows:
    """Inverse of :func:`encode_rows`; safetensors parsing never executes code."""
    if not isinstance(payload, (bytes, bytearray)):
        raise TypeError(f"capture payload must be bytes, got {type(payload).__name__}")
    t, meta = st_load(bytes(payload)), json.loads(bytes(payload[8 : 8 + int.from_bytes(payload[:8], "little")]))
    meta = meta.get("__metadata__") or {}
    return CapturedRows(tuple(json.loads(meta["layers"])), [t["hidden"]] if "hidden" in t else [], t["tags"],
                        t["samples"], t["positions"], t["token_ids"], t["chunk_offsets"], meta.get("error"),
                        json.loads(meta.get("stats", "{}")), "placed" in meta, int(meta.get("placed", 0)))


def empty_rows(layers: tuple[int, ...], hidden_size: int, dtype: torch.dtype, columns: int | None = None) -> CapturedRows:
    """No rows; ``columns`` defaults to one per layer (more when points are captured)."""
    z = torch.zeros(0, dtype=torch.int64)
    hidden = torch.empty(0, len(layers) if columns is None else columns, hidden_size, dtype=dtype)
    return CapturedRows(layers, hidden, z, z.clone(), z.clone(), z.clone(), torch.zeros(1, dtype=torch.int64))
