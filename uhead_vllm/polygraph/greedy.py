"""lm-polygraph's greedy statistics straight from vLLM ``RequestOutput``s.

lm-polygraph's ``GreedyProbsCalculator`` goes through the adapter's HF-shaped output: sequences
padded with EOS to the batch maximum and cut at the first EOS, so a sample that stopped on a stop
string or the length limit gets one extra token with log-likelihood -inf. Reading each sample's
own ``token_ids`` / ``logprobs`` keeps exact lengths.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..features import sampled_token_logprobs, topk_logprob_rows
from .adapter import LogprobsMissingError, logprob_rows

GREEDY_STATS: tuple[str, ...] = (
    "input_tokens",
    "greedy_log_probs",
    "greedy_tokens",
    "greedy_tokens_alternatives",
    "greedy_texts",
    "greedy_log_likelihoods",
)


def token_log_likelihoods(sample: Any) -> list[float]:
    """log p of each generated token, as vLLM computed it (it always returns the sampled token)."""
    if sample.logprobs is None:
        raise LogprobsMissingError("vLLM returned no logprobs; build SamplingParams with logprobs=k")
    return sampled_token_logprobs(sample.token_ids, sample.logprobs).tolist()


def topk_logprobs(sample: Any, k: int) -> np.ndarray:
    """``[T, k]`` float32: the k best log-probs per generated token, best first."""
    if sample.logprobs is None:
        raise LogprobsMissingError("vLLM returned no logprobs; build SamplingParams with logprobs=k")
    return topk_logprob_rows(sample.logprobs, k, 0, len(sample.token_ids)).numpy()


def alternatives(sample: Any, n: int) -> list[list[tuple[int, float]]]:
    """Per token: the chosen token first, then the other returned tokens by log-prob (n in all)."""
    out = []
    for tok, entry in zip(sample.token_ids, sample.logprobs):
        others = sorted(((i, lp.logprob) for i, lp in entry.items() if i != tok), key=lambda x: -x[1])
        out.append([(int(tok), float(entry[tok].logprob))] + [(int(i), float(v)) for i, v in others[: n - 1]])
    return out


def greedy_stats(outputs: Sequence[Any], vocab_size: int, n_alternatives: int = 10) -> dict[str, list]:
    """The greedy statistics of lm-polygraph for sample 0 of each ``RequestOutput``.

    ``greedy_log_probs`` rows are dense ``[T, vocab_size]`` (returned top-k, -inf elsewhere);
    ``greedy_texts`` is vLLM's detokenized text (no EOS, stop strings removed).
    """
    stats: dict[str, list] = {k: [] for k in GREEDY_STATS}
    for ro in outputs:
        if not ro.outputs:
            raise ValueError(f"request {ro.request_id} returned no samples")
        c = ro.outputs[0]
        stats["input_tokens"].append(list(ro.prompt_token_ids))
        stats["greedy_tokens"].append([int(t) for t in c.token_ids])
        stats["greedy_texts"].append(c.text)
        stats["greedy_log_likelihoods"].append(token_log_likelihoods(c))
        stats["greedy_log_probs"].append(logprob_rows(c, vocab_size).numpy())
        stats["greedy_tokens_alternatives"].append(alternatives(c, n_alternatives))
    return stats
