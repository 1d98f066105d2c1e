"""Multi-step online best-of-n: how many prompt tokens the engine forwards, against the minimum.

Each step samples ``candidates`` continuations (one line each) per question, picks one at random
(fixed seed) and appends its text to the prompt for the next step, as thinkbooster's online
best-of-n does. Three numbers per policy:

- forwarded: prompt tokens the engine actually forwarded (first pass + any recompute), derived
  from the capture rows: every forwarded position yields one captured row, and a sample's
  generated tokens yield ``len(output) - 1`` rows (the last sampled token is never forwarded);
- token minimum: each distinct prompt token (identified by the hash of its whole prefix) forwarded
  once, where a token whose prefix was already forwarded as a generated token of an earlier step
  counts as done;
- block minimum: what an ideal block-granular prefix cache would forward (vLLM caches full blocks
  only and always recomputes at least the prompt's last token), which is the floor for vLLM.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from .workload import MultiStepWorkload, rendered_prompts


class PrefixSet:
    """Set of token prefixes, each identified by a chained hash of all its tokens."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    @staticmethod
    def keys(token_ids: list[int]) -> list[int]:
        out, h = [], 0
        for t in token_ids:
            h = hash((h, int(t)))
            out.append(h)
        return out

    def add_new(self, keys: list[int]) -> int:
        """Add keys; return how many were new."""
        before = len(self._seen)
        self._seen.update(keys)
        return len(self._seen) - before

    def __contains__(self, key: int) -> bool:
        return key in self._seen

    def clear(self) -> None:
        self._seen.clear()


def block_floor(seq_tokens: list[list[int]], prompt_lens: list[int], cached: set, block: int) -> int:
    """Prompt tokens an ideal block-level prefix cache forwards for one step's requests.

    Blocks are identified by the chained hash of every token up to their end. A hit covers whole
    full blocks and at most ``prompt_len - 1`` tokens (vLLM always computes the last prompt token).
    Requests of the same step may hit blocks an earlier request in the step allocated. Afterwards
    the full blocks of every forwarded token (prompt + generated but the last) are cached.
    """
    forwarded = 0
    for toks, plen in zip(seq_tokens, prompt_lens):
        keys = PrefixSet.keys(toks)
        hit = 0
        while hit + block <= plen - 1 and keys[hit + block - 1] in cached:
            hit += block
        forwarded += plen - hit
        computed = len(toks) - 1
        for end in range(block, computed + 1, block):
            cached.add(keys[end - 1])
    return forwarded


@dataclass
class PolicyResult:
    policy: str
    prompt_tokens_forwarded: int = 0
    tokens_forwarded: int = 0
    generated_rows: int = 0
    rows_from_store: int = 0
    rows_recomputed: int = 0
    prefix_cache_rows: int = 0
    recompute_requests: int = 0
    token_minimum: int = 0
    block_minimum: int = 0
    seconds: float = 0.0
    per_step_prompt_forwarded: list = field(default_factory=list)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["vs_token_minimum"] = (self.prompt_tokens_forwarded / self.token_minimum
                                 if self.token_minimum else None)
        d["vs_block_minimum"] = (self.prompt_tokens_forwarded / self.block_minimum
                                 if self.block_minimum else None)
        return d


def _step_params(ms: MultiStepWorkload) -> Any:
    from vllm import SamplingParams

    return SamplingParams(n=ms.candidates, max_tokens=ms.max_step_tokens, temperature=ms.temperature,
                          stop=["\n"], include_stop_str_in_output=True)


def _count_step(res: Any, result: PolicyResult, token_min: PrefixSet, tok_block: set,
                block: int, reset: bool) -> None:
    st = res.stats
    samples = [s for per_prompt in res.hidden_states for s in per_prompt]
    generated_rows = sum(max(len(s.output_token_ids) - 1, 0) for s in samples)
    prompt_fwd = st.rows_captured - generated_rows + (st.tokens_forwarded - st.rows_captured)
    if st.rows_captured - generated_rows < 0:
        raise RuntimeError("fewer captured rows than generated tokens: counting is wrong")
    result.prompt_tokens_forwarded += prompt_fwd
    result.per_step_prompt_forwarded.append(prompt_fwd)
    result.tokens_forwarded += st.tokens_forwarded
    result.generated_rows += generated_rows
    result.rows_from_store += st.rows_from_store
    result.rows_recomputed += st.rows_recomputed
    result.prefix_cache_rows += st.prefix_cache_rows
    result.recompute_requests += st.recompute_requests
    if reset:  # the reset policy's own floor: nothing survives from one step to the next
        token_min.clear()
        tok_block.clear()
    for per_prompt in res.hidden_states:
        result.token_minimum += token_min.add_new(PrefixSet.keys(per_prompt[0].prompt_token_ids))
    result.block_minimum += block_floor([s.token_ids for s in samples],
                                        [s.prompt_len for s in samples], tok_block, block)
    for s in samples:
        token_min.add_new(PrefixSet.keys(s.token_ids[: len(s.token_ids) - 1]))


def run_policy(gen: Any, ms: MultiStepWorkload, *, reset_every_step: bool,
               step_prompts: list[list[str]] | None = None) -> tuple[PolicyResult, list[list[str]]]:
    """Run the best-of-n loop; with ``step_prompts`` replay those prompts instead of choosing.

    Replaying keeps the prompt tokens identical between policies (sampled texts may differ).
    """
    import time

    policy = "reset prefix cache every step" if reset_every_step else "keep prefix cache (ours)"
    result = PolicyResult(policy)
    rng = random.Random(ms.seed)
    sp = _step_params(ms)
    token_min, tok_block = PrefixSet(), set()
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    current = rendered_prompts(gen.tokenizer, ms.num_questions, seed=ms.seed + 1)
    used: list[list[str]] = []
    t0 = time.perf_counter()
    for step in range(ms.steps):
        prompts = step_prompts[step] if step_prompts is not None else current
        if reset_every_step and step > 0:
            gen.reset_hs_step_cache(reset_prefix_cache=True)
        res = gen.generate(prompts, sp)
        _count_step(res, result, token_min, tok_block, gen.block_size, reset_every_step)
        used.append(list(prompts))
        current = [p + rng.choice(list(ro.outputs)).text for p, ro in zip(prompts, res.outputs)]
        del res
    result.seconds = time.perf_counter() - t0
    return result, used


def run_multistep(gen: Any, ms: MultiStepWorkload) -> dict:
    """Ours (prefix cache kept) and the reset-every-step policy on the same prompts."""
    ours, prompts = run_policy(gen, ms, reset_every_step=False)
    reset, _ = run_policy(gen, ms, reset_every_step=True, step_prompts=prompts)
    # The reset policy's token floor counts each step alone; the global floor is ours'.
    out = {"workload": ms.to_dict(), "block_size": gen.block_size,
           "ours": ours.to_dict(), "reset": reset.to_dict()}
    out["reset_vs_ours_forwarded"] = (reset.prompt_tokens_forwarded / ours.prompt_tokens_forwarded
                                      if ours.prompt_tokens_forwarded else None)
    out["reset_vs_global_token_minimum"] = (reset.prompt_tokens_forwarded / ours.token_minimum
                                            if ours.token_minimum else None)
    gen.reset_hs_step_cache(reset_prefix_cache=True)
    return out


__all__ = ["PrefixSet", "block_floor", "PolicyResult", "run_policy", "run_multistep"]
