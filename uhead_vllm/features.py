"""Per-step features from captured hidden states (+ optional top-k logprob features).

Alignment convention (read this before building features)
---------------------------------------------------------
The engine side hands over ``hidden: Tensor[T, L, H]`` for one generated answer: one row per token
position of prompt + generated tokens, ``L`` captured layers in Hugging Face ``output_hidden_states``
indexing (0 = embeddings, k = residual stream after decoder layer k-1), hidden size ``H``.

Row ``p`` is the state computed while token ``p`` was the *input*: it has read token ``p`` and
predicts token ``p + 1``. We adopt one convention everywhere:

    the features of a step are the rows at the step's own token positions,
    i.e. the states *after reading* each token of the step.

So the last row of a step has read the whole step — the natural summary for "is this step valid".
The top-k logprob features of token ``p`` (when a recipe asks for them) are the distribution that
token ``p`` was sampled from; both parts therefore describe the same token ``p``.

The last sampled token of a sequence is never forwarded, so it usually has no row: ``T`` can be
``prompt_len + n_generated - 1``. Callers pass the rows they have; :func:`step_token_features`
raises a clear error for a span that needs a missing row, and :func:`clip_span` trims a span to
the available rows (typically dropping a trailing EOS token from the last step).

Step spans are half-open token positions *relative to the first generated token*.
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Literal, Protocol, Sequence

import torch

Pooling = Literal["mean", "last", "mean_last"]
POOLINGS: tuple[str, ...] = ("mean", "last", "mean_last")

# A sentence ends at . ! ? (runs like "..." or "?!" included, closing quotes/brackets kept with it)
# when followed by whitespace or the end of the text; "3.14" and "e.g.x" are not split.
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*(?=\s|$)")


class _Decoder(Protocol):
    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


DecodeFn = Callable[[list[int]], str]


@dataclass(frozen=True)
class StepSpan:
    """Half-open range ``[start, end)`` of generated-token positions forming one step."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid StepSpan({self.start}, {self.end}): need 0 <= start <= end")

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class FeatureRecipe:
    """How per-token features are built; stored with a head so it is applied identically later.

    ``layers`` are HF ``output_hidden_states`` indices; ``pooling`` is how a step's token matrix is
    reduced for heads that need one vector per step; ``logprob_topk`` top-k logprobs per token are
    appended after the concatenated layers (0 = none).
    """

    layers: list[int]
    pooling: Pooling = "mean"
    logprob_topk: int = 0

    def __post_init__(self) -> None:
        self.layers = [int(x) for x in self.layers]
        if not self.layers:
            raise ValueError("FeatureRecipe.layers must name at least one layer")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"FeatureRecipe.layers has duplicates: {self.layers}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {self.pooling!r}; expected one of {POOLINGS}")
        if self.logprob_topk < 0:
            raise ValueError(f"logprob_topk must be >= 0, got {self.logprob_topk}")

    @property
    def window(self) -> str:
        """The capture window the recipe reads (``VllmHiddenStatesGenerator.generate(window=...)``):
        a step's features are rows at its own generated positions, so only generated rows."""
        return "generated"

    def token_dim(self, hidden_size: int) -> int:
        """Per-token feature size F = len(layers) * H + logprob_topk."""
        return len(self.layers) * hidden_size + self.logprob_topk

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FeatureRecipe":
        return cls(**data)


# ----------------------------------------------------------------------------------------------
# Step splitting
# ----------------------------------------------------------------------------------------------


def _as_decode_fn(decoder: _Decoder | DecodeFn) -> DecodeFn:
    """Accept a HF-like tokenizer or a plain ``ids -> str`` function."""
    if hasattr(decoder, "decode"):
        tok = decoder

        def decode(ids: list[int]) -> str:
            # Special tokens (EOS) get zero width; no clean-up so prefixes stay prefixes.
            return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

        return decode
    if callable(decoder):
        return decoder
    raise TypeError(f"decoder must be a tokenizer with .decode or a callable, got {type(decoder)}")


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[:hi + 1] != b[:hi + 1]
    while lo < hi:  # bisect with slice comparisons (memcmp), not a loop over characters
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


#: Tokens of context decoded before each token to read its text off (a fast tokenizer's decoders
#: look back only a few tokens: a character split over byte tokens, a word's leading space).
_CONTEXT_TOKENS = 12


def _ends_with(full: str, agreed: int, tail: str, suffix: str) -> bool:
    """Whether ``full[:agreed] + tail`` ends with ``suffix`` (built only as far as needed)."""
    if len(suffix) <= len(tail):
        return tail.endswith(suffix)
    head = len(suffix) - len(tail)
    return head <= agreed and full[agreed - head : agreed] + tail == suffix


class AnswerOffsets:
    """Character offsets of an answer's tokens (:meth:`char_ends`), kept between calls: an answer
    that grows (a running request's, split again at each possible step end) costs only its new
    tokens' work.

    A token's text ends where the decoded text of the prefix up to it stops agreeing with the
    whole text (a running max). A prefix that ends inside a multi-token character decodes to a
    replacement char, so such partial tokens get zero width and the character goes to the token
    that completes it. With a fast tokenizer the prefixes are not decoded one by one (quadratic:
    1.2 s for a 4,096-token answer): each token's text is read off a short window,
    ``ids[k-C:k]`` against ``ids[k-C:k+1]``, all windows in one call into the backend, and the
    prefix text is kept as the part that agrees with the whole text plus a short disagreeing tail
    (a character whose bytes are not all there yet). Where the window's text before the token is
    not where the prefix text ends (a window that begins inside a character) or is empty, that
    one prefix is decoded whole. The result is what decoding every prefix gives
    (``tests/test_heads.py`` compares the two); other decoders decode every prefix.
    """

    def __init__(self, decoder: _Decoder | DecodeFn) -> None:
        self.decode = _as_decode_fn(decoder)
        self.backend: Any = getattr(decoder, "backend_tokenizer", None)  # a fast tokenizer's (None: other decoders)
        self.ids: list[int] = []  # the tokens measured so far
        self.windows: list[tuple[str, str]] = []  # per token: its window's text without it, with it
        self.full = ""  # the text they were measured against
        self.states: list[tuple[int, str]] = []  # per token: its prefix text as (chars agreeing, tail)
        self.reach: list[int] = []  # per token: the longest prefix text up to it (what its state read)
        self.ends: list[int] = []  # per token: chars agreeing, a running max (its end but for the last)
        self.kept = 0  # tokens whose state the last call kept
        self.steps: dict[str, tuple[str, list[int]]] = {}  # split_steps' last text and step per token, by mode

    def char_ends(self, token_ids: Sequence[int]) -> tuple[str, list[int]]:
        """The whole text and the character offset where each token's text ends."""
        ids = list(map(int, token_ids))
        full = self.decode(ids)
        backend = self.backend
        if backend is not None and ids and backend.decode(ids, skip_special_tokens=True) == full:
            self._measure(ids, full)
            ends = self.ends[:]
        else:  # one decode per prefix
            agreement = [_common_prefix_len(self.decode(ids[:k]), full) for k in range(1, len(ids) + 1)]
            ends = list(itertools.accumulate(agreement, max))
            self.ids, self.kept = [], 0
        if ends:
            ends[-1] = len(full)
        return full, ends

    def _measure(self, ids: list[int], full: str) -> None:
        """Each prefix ``ids[:k+1]``'s agreement with ``full``, from the first token whose state
        could have changed since the last call."""
        kept = len(self.ids)
        if ids[:kept] != self.ids:  # not a continuation: start afresh
            kept = 0
        self._read_windows(ids, kept)
        # A token's state stays valid while everything its step read of the whole text is unchanged.
        k = bisect.bisect_right(self.reach, _common_prefix_len(self.full, full), 0, kept) if kept else 0
        del self.states[k:], self.reach[k:], self.ends[k:]
        self.kept = k
        agreed, tail = self.states[-1] if self.states else (0, "")
        backend = self.backend
        for k in range(k, len(ids)):
            before, now = self.windows[k]
            keep = agreed + len(tail) - len(before)  # the prefix text's length before the window's
            # An empty window text (its tokens decode to nothing) does not anchor the token's: a
            # decoder that strips the text's first space would strip the token's own.
            if keep >= 0 and (before or k <= _CONTEXT_TOKENS) and _ends_with(full, agreed, tail, before):
                base, rest = (keep, now) if keep <= agreed else (agreed, tail[: keep - agreed] + now)
            else:
                base, rest = 0, backend.decode(ids[: k + 1], skip_special_tokens=True)
            shared = _common_prefix_len(rest, full[base : base + len(rest)])
            agreed, tail = base + shared, rest[shared:]
            self.states.append((agreed, tail))
            self.reach.append(max(agreed + len(tail), self.reach[-1] if self.reach else 0))
            self.ends.append(max(agreed, self.ends[-1] if self.ends else 0))
        self.ids, self.full = ids, full

    def steps_kept(self, mode: str, text: str, ends: list[int]) -> list[int]:
        """The step of each leading token that :func:`split_steps` can keep from its last split
        of this answer (``text``, ``ends``: this one's): tokens whose offsets were kept and whose
        text, and every step cut up to it, lie where the two texts agree (a cut needs the
        character after it)."""
        if mode not in self.steps:
            return []
        old_text, old_steps = self.steps[mode]
        same = min(_common_prefix_len(old_text, text), len(old_text) - 2)
        k = min(self.kept, len(old_steps) - 1, bisect.bisect_right(ends, same))
        return old_steps[: max(k, 0)]

    def _read_windows(self, ids: list[int], kept: int) -> None:
        """The window texts of the tokens from ``kept`` on (a token's depends only on the tokens up
        to it), all in one call into the backend."""
        new = range(kept, len(ids))
        starts = [max(0, k - _CONTEXT_TOKENS) for k in new]
        texts = self.backend.decode_batch([ids[s:k] for k, s in zip(new, starts)]
                                          + [ids[s : k + 1] for k, s in zip(new, starts)], skip_special_tokens=True)
        del self.windows[kept:]
        self.windows += zip(texts[: len(new)], texts[len(new) :])


def token_char_ends(token_ids: Sequence[int], decoder: _Decoder | DecodeFn) -> tuple[str, list[int]]:
    """Decode the full text and the character offset where each token's text ends (see
    :class:`AnswerOffsets`, which keeps what it measured for an answer that grows)."""
    return AnswerOffsets(decoder).char_ends(token_ids)


def _cut_positions(text: str, mode: str) -> list[int]:
    """Character positions where a new step starts (sorted, unique, inside the text)."""
    cuts = {m.end() for m in re.finditer("\n", text)}
    if mode == "sentence":
        cuts |= {m.end() for m in _SENTENCE_END.finditer(text)}
    elif mode != "line":
        raise ValueError(f"unknown split mode {mode!r}; expected 'line' or 'sentence'")
    return sorted(c for c in cuts if 0 < c < len(text))


def _validate_spans(spans: Sequence[StepSpan | tuple[int, int]], n_tokens: int) -> list[StepSpan]:
    out = [s if isinstance(s, StepSpan) else StepSpan(int(s[0]), int(s[1])) for s in spans]
    prev_end = 0
    for s in out:
        if len(s) == 0:
            raise ValueError(f"empty step span {s}")
        if s.start < prev_end:
            raise ValueError(f"step spans must be sorted and non-overlapping; {s} starts before {prev_end}")
        if s.end > n_tokens:
            raise ValueError(f"step span {s} exceeds the {n_tokens} generated tokens")
        prev_end = s.end
    return out


def split_steps(
    token_ids: Sequence[int],
    decoder: _Decoder | DecodeFn | AnswerOffsets | None = None,
    mode: Literal["line", "sentence"] = "line",
    spans: Sequence[StepSpan | tuple[int, int]] | None = None,
) -> list[StepSpan]:
    """Split generated tokens into steps, by newlines (``line``) or sentence ends (``sentence``).

    Splitting works on decoded text so it does not depend on how a tokenizer groups characters.
    A token belongs to the step holding its first non-whitespace character (whitespace-only tokens:
    their first character), so ``".\\n"`` closes a line and ``"\\nThe"`` opens the next one.
    Whitespace-only steps are merged into the previous step (the next one if first). Pass ``spans``
    to use explicit steps from the caller instead; they are validated and returned. ``decoder``
    may be an :class:`AnswerOffsets` kept for an answer split again as it grows.
    """
    n = len(token_ids)
    if spans is not None:
        return _validate_spans(spans, n)
    if decoder is None:
        raise ValueError("split_steps needs a decoder (tokenizer or decode fn) unless spans are given")
    if n == 0:
        return []
    offsets = decoder if isinstance(decoder, AnswerOffsets) else AnswerOffsets(decoder)
    text, ends = offsets.char_ends(token_ids)
    cuts = _cut_positions(text, mode)

    seg = offsets.steps_kept(mode, text, ends)  # a growing answer's leading tokens keep their steps
    start = ends[len(seg) - 1] if seg else 0
    for end in ends[len(seg) :]:
        piece = text[start:end]
        if not piece:  # zero-width token: stays with its predecessor
            seg.append(seg[-1] if seg else 0)
        else:
            offset = len(piece) - len(piece.lstrip())
            anchor = start + (offset if offset < len(piece) else 0)
            seg.append(max(bisect.bisect_right(cuts, anchor), seg[-1] if seg else 0))
        start = end
    offsets.steps[mode] = (text, seg)

    raw: list[StepSpan] = []
    begin = 0
    for k in range(1, n + 1):
        if k == n or seg[k] != seg[k - 1]:
            raw.append(StepSpan(begin, k))
            begin = k

    def span_text(s: StepSpan) -> str:
        lo = ends[s.start - 1] if s.start > 0 else 0
        return text[lo : ends[s.end - 1]]

    merged: list[StepSpan] = []
    pending_start: int | None = None  # leading whitespace-only tokens waiting for a first step
    for s in raw:
        if span_text(s).strip():
            if pending_start is not None:
                s, pending_start = StepSpan(pending_start, s.end), None
            merged.append(s)
        elif merged:
            merged[-1] = StepSpan(merged[-1].start, s.end)
        elif pending_start is None:
            pending_start = s.start
    if pending_start is not None:  # the whole answer is whitespace: one step
        merged.append(StepSpan(pending_start, n))
    return merged


# ----------------------------------------------------------------------------------------------
# Features
# ----------------------------------------------------------------------------------------------


def sampled_token_logprobs(token_ids: Sequence[int], logprobs: Sequence[Any], start: int = 0,
                           end: int | None = None) -> torch.Tensor:
    """``[end - start]`` float32: log p of each sampled token ``token_ids[start:end]`` as vLLM
    computed it (vLLM always returns the sampled token next to its top-k)."""
    end = len(token_ids) if end is None else end
    if len(logprobs) < end:
        raise ValueError(f"logprobs cover {len(logprobs)} generated tokens, {end} needed")
    out = torch.empty(max(end - start, 0), dtype=torch.float32)
    for row, pos in enumerate(range(start, end)):
        tok, entry = int(token_ids[pos]), logprobs[pos]
        if entry is None or tok not in entry:
            raise ValueError(f"vLLM logprobs at generated position {pos} lack the sampled token {tok}")
        out[row] = float(getattr(entry[tok], "logprob", entry[tok]))
    return out


def topk_logprob_rows(logprobs: Sequence[Any], k: int, start: int = 0, end: int | None = None) -> torch.Tensor:
    """``[end - start, k]`` float32: the k largest log-probs of generated tokens ``start..end-1``,
    best first (the columns a recipe's ``logprob_topk`` appends), from vLLM's per-token
    ``{token_id: Logprob}`` dicts. vLLM returns its top-N plus the sampled token, so with N >= k
    the k largest values are the model's top-k. The one place that defines these columns, so
    training data and every scorer read them the same way."""
    end = len(logprobs) if end is None else end
    rows = []
    for pos in range(start, end):
        entry = logprobs[pos] if pos < len(logprobs) else None
        if entry is None:
            raise ValueError(f"no logprobs for generated token {pos}; request SamplingParams(logprobs >= {k})")
        values = sorted((float(getattr(v, "logprob", v)) for v in entry.values()), reverse=True)
        if len(values) < k:
            raise ValueError(f"generated token {pos} has {len(values)} logprobs, {k} needed; "
                             f"request SamplingParams(logprobs >= {k})")
        rows.append(values[:k])
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), k)  # one tensor, not one per token


def clip_span(span: StepSpan, prompt_len: int, num_rows: int) -> StepSpan | None:
    """Trim ``span`` to the rows that exist (the last sampled token has none); None if nothing is left."""
    end = min(span.end, num_rows - prompt_len)
    return StepSpan(span.start, end) if end > span.start else None


def _layer_positions(recipe: FeatureRecipe, num_layers: int, captured_layers: Sequence[int] | None) -> list[int]:
    if captured_layers is None:
        if num_layers != len(recipe.layers):
            raise ValueError(
                f"hidden has {num_layers} layers but the recipe wants {len(recipe.layers)} "
                f"({recipe.layers}); pass captured_layers to say which HF indices hidden holds"
            )
        return list(range(num_layers))
    captured = [int(x) for x in captured_layers]
    if len(captured) != num_layers:
        raise ValueError(f"captured_layers names {len(captured)} layers but hidden has {num_layers}")
    missing = [x for x in recipe.layers if x not in captured]
    if missing:
        raise ValueError(f"recipe layers {missing} were not captured (captured: {captured})")
    return [captured.index(x) for x in recipe.layers]


def step_token_features(
    hidden: torch.Tensor,
    prompt_len: int,
    span: StepSpan,
    recipe: FeatureRecipe,
    topk_logprobs: torch.Tensor | None = None,
    captured_layers: Sequence[int] | None = None,
) -> torch.Tensor:
    """Per-token feature matrix ``[len(span), F]`` (float32) of one step, F = L*H + logprob_topk.

    Rows are ``hidden[prompt_len + span.start : prompt_len + span.end]`` (state after reading each
    step token, see module docstring), the recipe's layers concatenated in recipe order, then the
    first ``logprob_topk`` columns of ``topk_logprobs[T_gen, k]`` (indexed by generated position,
    sorted best first). ``captured_layers`` maps hidden's L axis to HF indices; without it, hidden
    must hold exactly the recipe's layers in order.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [T, L, H], got shape {tuple(hidden.shape)}")
    if len(span) == 0:
        raise ValueError(f"empty step span {span}")
    num_rows = hidden.shape[0]
    lo, hi = prompt_len + span.start, prompt_len + span.end
    if prompt_len < 0 or hi > num_rows:
        raise ValueError(
            f"span {span} needs hidden rows [{lo}, {hi}) but only {num_rows} rows are available "
            f"(prompt_len={prompt_len}); the last sampled token has no row — use clip_span"
        )
    idx = _layer_positions(recipe, hidden.shape[1], captured_layers)
    rows = hidden[lo:hi, idx, :]
    k = recipe.logprob_topk
    if k == 0:
        return rows.to(torch.float32).reshape(len(span), -1)
    if topk_logprobs is None:
        raise ValueError(f"recipe wants logprob_topk={k} but no topk_logprobs were given")
    if topk_logprobs.dim() != 2 or topk_logprobs.shape[1] < k:
        raise ValueError(f"topk_logprobs must be [T_gen, >= {k}], got shape {tuple(topk_logprobs.shape)}")
    if topk_logprobs.shape[0] < span.end:
        raise ValueError(f"span {span} exceeds topk_logprobs rows ({topk_logprobs.shape[0]})")
    # One pass over the rows: converted as they are written into the feature matrix (no float32
    # copy of them first): a step's rows are megabytes at 8B, on the server's event loop.
    width = rows.shape[1] * rows.shape[2]
    out = torch.empty(len(span), width + k, dtype=torch.float32)
    out[:, :width].view(len(span), rows.shape[1], rows.shape[2]).copy_(rows)
    out[:, width:] = topk_logprobs[span.start : span.end, :k]
    return out


def pool(features: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """Reduce a step's ``[t, F]`` matrix to one vector: mean ``[F]``, last ``[F]``, mean_last ``[2F]``."""
    if features.dim() != 2 or features.shape[0] == 0:
        raise ValueError(f"pool needs a non-empty [t, F] matrix, got shape {tuple(features.shape)}")
    if pooling == "mean":
        return features.mean(dim=0)
    if pooling == "last":
        return features[-1]
    if pooling == "mean_last":
        return torch.cat([features.mean(dim=0), features[-1]])
    raise ValueError(f"unknown pooling {pooling!r}; expected one of {POOLINGS}")


def pooled_dim(token_dim: int, pooling: Pooling) -> int:
    """Size of :func:`pool`'s output for per-token size ``token_dim``."""
    return 2 * token_dim if pooling == "mean_last" else token_dim
