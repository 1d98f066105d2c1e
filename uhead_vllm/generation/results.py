"""What a generate call returns: vLLM's outputs, every sample's exact rows, and counters.

These are plain result types; :func:`collect` builds them from a call's completed sequences and
links each sample to the steps of the trajectory it continues (the step cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..capture.points import ALIASES
from .step_cache import StepCache, StepRecord
from .steering import step_key


@dataclass
class GenerationStats:
    """Counters the caller can read (cumulative on the generator, per call on each result)."""

    tokens_forwarded: int = 0  # rows vLLM actually computed for tagged requests (incl. recompute)
    rows_captured: int = 0  # rows taken from the first pass
    rows_placed: int = 0  # of those, rows the worker wrote into their place while vLLM generated
    rows_written_on_device: int = 0  # of those, rows the GPU wrote into the shared row file itself
    prefix_cache_rows: int = 0  # rows of the capture windows vLLM skipped because their KV was cached
    capture_missed_rows: int = 0  # rows vLLM computed but capture did not record (a defect)
    rows_skipped: int = 0  # rows vLLM computed below the samples' capture windows: never recorded nor copied
    rows_shared: int = 0  # prompt rows a sample reads from its prompt's one copy (sample 0's), not its own
    bytes_to_host: int = 0  # bytes of the rows the worker recorded and sent to the host (incl. recompute)
    forwards_seen: int = 0  # model forwards the worker saw during the first pass
    forwards_recorded: int = 0  # of those, forwards whose tagged rows were recorded
    forwards_replayed: int = 0  # of those, forwards whose row copy replayed a CUDA graph (GPU)
    record_seconds: float = 0.0  # worker time on the engine's thread recording rows (first pass)
    place_seconds: float = 0.0  # worker time writing rows into place beside the engine (first pass)
    rows_from_store: int = 0
    rows_from_shared_prefix: int = 0  # prefix-cached prompt rows another request of the call forwarded
    rows_recomputed: int = 0
    recompute_requests: int = 0
    store_evictions: int = 0
    store_stale_drops: int = 0  # stored blocks retired because their rows were changed in place
    # A level, not a count (the cumulative stats keep the latest): bytes of row buffers the
    # generator keeps alive after the call, for the prefix row store and the step cache together.
    held_bytes: int = 0

    def add(self, other: "GenerationStats") -> None:
        for f in fields(self):
            level = f.name == "held_bytes"
            setattr(self, f.name, getattr(other, f.name) + (0 if level else getattr(self, f.name)))


@dataclass
class SampleHiddenStates:
    """Rows for one sample: ``hidden[p - first_row]`` is the state after reading ``token_ids[p]``.

    ``token_ids`` = ``prompt_token_ids`` + ``output_token_ids`` exactly as vLLM ran them. The last
    sampled token is never forwarded by vLLM, so ``hidden`` has ``len(token_ids) - 1 - first_row``
    rows unless the last token was computed on request (``compute_last_token=True``).

    ``first_row`` is the position of ``hidden[0]``: 0 with the capture window ``"all"`` (the
    default), ``prompt_len`` with ``"generated"``, ``prompt_len - k`` with k prompt rows. ``layer``
    and ``point`` give the window's rows, ``generated_rows`` and ``steps`` the generated tokens'
    rows, for every window.

    ``last_row_missing`` is True when the last row was asked for but cannot exist: the sequence
    fills ``max_model_len`` and vLLM refuses to forward a prompt that long. Such a sample keeps
    ``len(token_ids) - 1`` exact rows instead of failing the whole call.

    The samples of one prompt share its rows: ``prompt_rows`` (the window's rows at prompt
    positions) of every sample are one view of the rows sample 0 recorded, ``own_rows`` are the
    sample's own (its generated tokens' positions); neither is ever a copy. ``hidden`` is both in
    one contiguous tensor: for sample 0 (and any sample of n=1) a view, for the others built by
    concatenation on the first ask and then kept.

    The rows are views into one buffer that holds every sample of the call, shared (not copied)
    with the generator's prefix row store and step cache. Editing them in place is safe but not
    free: the store notices (the buffer's version counter) and recomputes those rows when a later
    call needs them. Clone first to edit rows without that cost.

    ``reduced``: the engine was built with a head's ``token_inputs``, so ``hidden`` is ``[rows, 1, D]``
    float32: the head's reduced inputs, not hidden states (``layer`` and ``point`` refuse).
    """

    prompt_index: int
    sample_index: int
    prompt: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    layers: tuple[int, ...]
    prompt_rows: torch.Tensor  # [prompt_len - first_row, L, H]: a view, shared by the prompt's samples
    own_rows: torch.Tensor  # [rows at generated positions, L, H]; [.., L, S * H] for S residual streams
    steps: list[StepRecord] = field(default_factory=list)
    last_row_missing: bool = False
    points: tuple[tuple[str, int], ...] = ()  # (point, decoder layer) of the columns after the layers
    streams: int = 1  # parallel residual streams per token (DeepSeek-V4 mHC: hc_mult)
    first_row: int = 0  # position of ``hidden[0]`` (the capture window's start)
    reduced: bool = False  # rows are a head's reduced inputs [rows, 1, D], not hidden states
    _hidden: torch.Tensor | None = field(default=None, repr=False)  # the window's rows in one tensor, once built

    @property
    def hidden(self) -> torch.Tensor:
        """The window's rows ``[rows, L, H]`` in one tensor: ``prompt_rows`` then ``own_rows`` (built
        once, on the first ask, where the prompt rows are another sample's). With ``reduced``:
        ``[rows, 1, D]``, the head's reduced inputs, not hidden states."""
        if self._hidden is None:
            self._hidden = torch.cat([self.prompt_rows, self.own_rows])
        return self._hidden

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def layer(self, k: int) -> torch.Tensor:
        """Rows of HF hidden-state index ``k`` as ``[rows, H]`` (from ``first_row`` on); ``[rows, S, H]`` (every stream, HF's
        layout) for a model of ``S > 1`` residual streams."""
        self._refuse_reduced(f"layer({k})")
        if k not in self.layers:
            raise KeyError(f"layer {k} was not captured; captured layers: {self.layers}")
        rows = self._column(self.layers.index(k))
        return rows if self.streams == 1 else rows.unflatten(-1, (self.streams, -1))

    def point(self, name: str, layer: int) -> torch.Tensor:
        """Rows of capture point ``name`` (e.g. ``"mlp_out"``) of decoder layer ``layer`` as ``[rows, H]``
        (from ``first_row`` on)."""
        self._refuse_reduced(f"point({name!r}, {layer})")
        site = (ALIASES.get(name, name), int(layer))
        if site not in self.points:
            raise KeyError(f"point {name}.{layer} was not captured; captured points: {list(self.points)}")
        return self._column(len(self.layers) + self.points.index(site))

    def _refuse_reduced(self, what: str) -> None:
        if self.reduced:
            raise ValueError(f"{what}: this engine reduces rows to a head's inputs on the device (token_inputs), "
                             "so hidden is [rows, 1, D], not hidden states; build it without token_inputs for layers")

    def _column(self, j: int) -> torch.Tensor:
        """Column ``j`` of every row: a view once ``hidden`` exists, else only this column joined."""
        if self._hidden is not None:
            return self._hidden[:, j]
        return torch.cat([self.prompt_rows[:, j], self.own_rows[:, j]])

    def generated_rows(self) -> torch.Tensor:
        """Rows at the generated tokens' positions that exist (see class docstring), any window:
        ``own_rows``, never a copy."""
        return self.own_rows


@dataclass
class HiddenStatesGeneration:
    outputs: list[Any]  # vLLM RequestOutput per prompt, ``outputs[i].outputs[s]`` = sample s
    hidden_states: list[list[SampleHiddenStates]]  # [prompt][sample]
    stats: GenerationStats


def collect(plan: Any, seqs: list[Any], step_cache: StepCache, stats: GenerationStats, layers: tuple[int, ...],
            points: tuple[tuple[str, int], ...], streams: int, reduced: bool = False) -> HiddenStatesGeneration:
    """The call's result: per prompt one merged vLLM output and every sample's rows, each sample
    linked to the steps of the trajectory it continues (looked up for the whole call first, so
    candidates of this call never parent each other). ``seqs``: the call's completed
    :class:`~.sequences.Sequence` objects, in plan order (a prompt's sample 0 first, whose rows
    hold the prompt part every sample of it shares)."""
    prompts = plan.prompts
    step_cache.begin_call()
    keys = [step_key(q.prompt, q.step_salt) for q in seqs]
    parents = {k: step_cache.history_for(k) for k in dict.fromkeys(keys)}  # once per prompt
    hidden: list[list[SampleHiddenStates]] = [[] for _ in prompts]
    merged: list[Any] = [None] * len(prompts)
    # vLLM's outputs of this call's own requests reach no one else: one per prompt becomes its
    # merged output, each sample's completion keeps its object (no copies).
    holder: dict[int, Any] = {}  # prompt -> the sequence holding its prompt rows (its sample 0)
    for q, key in zip(seqs, keys):
        i = q.prompt_index
        rep = holder.setdefault(i, q)
        out = q.output
        out.index = q.sample
        if merged[i] is None:
            merged[i] = q.request_output
            merged[i].outputs = []
            if _is_text(prompts[i]):  # sent as token ids (see plan.pretokenized): the text, as vLLM gives it
                merged[i].prompt = plan.rendered[i][1]
        merged[i].outputs.append(out)
        prompt_ids = list(q.request_output.prompt_token_ids)
        p, f = len(prompt_ids), q.first_row
        sample = SampleHiddenStates(
            prompt_index=i, sample_index=q.sample, prompt=q.prompt, prompt_token_ids=prompt_ids,
            output_token_ids=list(q.output.token_ids), text=q.output.text, layers=layers,
            prompt_rows=rep.rows[f:p], own_rows=q.rows[p:], last_row_missing=q.last_row_missing, points=points,
            streams=streams, first_row=f, reduced=reduced, _hidden=q.rows[f:] if rep is q else None,
        )
        record = StepRecord(text=q.output.text, token_ids=sample.output_token_ids,
                            hidden=q.rows[len(prompt_ids):])  # a view; compacted if continued
        sample.steps = step_cache.extend(key, record, parents[key])
        hidden[i].append(sample)
    return HiddenStatesGeneration(outputs=merged, hidden_states=hidden, stats=stats)


def _is_text(prompt: Any) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)
