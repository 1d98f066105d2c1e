"""Per-forward recording of tagged requests' rows, inside the worker.

The recorder is plain Python over tensors: it is handed the aux hidden states of one forward and the
batch layout, keeps the rows of tagged requests only, and turns them into one safetensors payload on
fetch. Untagged requests cost one dict lookup per forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .protocol import CapturedRows, CaptureSettings, RequestTag, empty_rows


@dataclass
class _Chunk:
    tag: int
    sample: int
    positions: torch.Tensor
    token_ids: torch.Tensor
    hidden: torch.Tensor


@dataclass
class RowRecorder:
    """Accumulates captured chunks until the engine fetches them."""

    settings: CaptureSettings
    aux_layers: tuple[int, ...]  # the layers the model emits, sorted (vLLM sorts them)
    hidden_size: int
    chunks: list[_Chunk] = field(default_factory=list)
    bytes_held: int = 0
    error: str | None = None
    forwards_seen: int = 0
    forwards_recorded: int = 0
    rows_recorded: int = 0
    _tags: dict[str, RequestTag | None] = field(default_factory=dict)
    _owner: dict[tuple[int, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Map requested layer order onto the (sorted) aux output order.
        self._select = [self.aux_layers.index(k) for k in self.settings.layers]

    def tag_of(self, req_id: str, extra_args: dict | None) -> RequestTag | None:
        if req_id in self._tags:
            return self._tags[req_id]
        tag = RequestTag.from_extra_args(extra_args)
        if tag is not None:
            key = (tag.tag, tag.sample)
            other = self._owner.get(key)
            if other is not None and other != req_id and self.error is None:
                self.error = (
                    f"requests {other!r} and {req_id!r} carry the same capture tag {key}: "
                    "sampling with n>1 must go through VllmHiddenStatesGenerator, which gives "
                    "every sample its own tag"
                )
            self._owner[key] = req_id
        self._tags[req_id] = tag
        return tag

    def record(
        self,
        req_ids: list[str],
        query_start_loc: list[int],
        tags: list[RequestTag | None],
        positions: torch.Tensor,
        input_ids: torch.Tensor,
        aux: list[torch.Tensor],
    ) -> None:
        self.forwards_seen += 1
        if self.error is not None or not any(t is not None for t in tags):
            return
        if positions.dim() > 1:  # M-RoPE style [3, T]: the text position is row 0
            positions = positions[0]
        picked = [aux[j] for j in self._select]
        dtype = self.settings.torch_dtype
        new_bytes = 0
        pending: list[_Chunk] = []
        for rid, tag, a, b in zip(req_ids, tags, query_start_loc[:-1], query_start_loc[1:]):
            if tag is None or b <= a:
                continue
            hidden = torch.stack([h[a:b] for h in picked], dim=1).to(dtype=dtype, copy=True)
            pending.append(_Chunk(tag.tag, tag.sample, positions[a:b].to(torch.int64).clone(),
                                  input_ids[a:b].to(torch.int64).clone(), hidden))
            new_bytes += hidden.numel() * hidden.element_size()
        if self.bytes_held + new_bytes > self.settings.max_bytes:
            self.error = (
                f"capture memory budget exceeded: holding {self.bytes_held} bytes, this forward "
                f"adds {new_bytes}, budget max_bytes={self.settings.max_bytes}. Raise max_bytes, "
                "capture fewer layers or use bfloat16, or generate in smaller batches"
            )
            self.chunks.clear()
            self.bytes_held = 0
            return
        self.chunks.extend(pending)
        self.bytes_held += new_bytes
        self.forwards_recorded += 1
        self.rows_recorded += sum(c.positions.numel() for c in pending)

    def take(self, live_req_ids: set[str]) -> CapturedRows:
        """Hand over everything recorded so far and start afresh (forget finished requests)."""
        layers = tuple(self.settings.layers)
        dtype = self.settings.torch_dtype
        stats = {"forwards_seen": self.forwards_seen, "forwards_recorded": self.forwards_recorded,
                 "rows_recorded": self.rows_recorded, "bytes": self.bytes_held}
        if not self.chunks:
            rows = empty_rows(layers, self.hidden_size, dtype)
        else:
            lens = torch.tensor([c.positions.numel() for c in self.chunks], dtype=torch.int64)
            rows = CapturedRows(
                layers=layers,
                hidden=torch.cat([c.hidden for c in self.chunks]),
                tags=torch.repeat_interleave(torch.tensor([c.tag for c in self.chunks]), lens),
                samples=torch.repeat_interleave(torch.tensor([c.sample for c in self.chunks]), lens),
                positions=torch.cat([c.positions for c in self.chunks]),
                token_ids=torch.cat([c.token_ids for c in self.chunks]),
                chunk_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
            )
        rows.error = self.error
        rows.stats = stats
        self.chunks = []
        self.bytes_held = 0
        self.error = None
        self.forwards_seen = self.forwards_recorded = self.rows_recorded = 0
        self._tags = {r: t for r, t in self._tags.items() if r in live_req_ids}
        self._owner = {k: r for k, r in self._owner.items() if r in live_req_ids}
        return rows
