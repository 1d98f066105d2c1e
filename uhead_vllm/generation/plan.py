"""Stage 1 of a generate call: the plan, one list of the requests the call sends to vLLM.

Needs the caller's prompts and sampling params, the tokenizer and the engine's steering check.
Produces a :class:`CallPlan`: every prompt rendered once (text prompts as token ids, as vLLM
would tokenize them), and one :class:`PlannedRequest` per sample, each with its own capture tag,
its capture window, its own one-sample ``SamplingParams`` and its cache keys (see steering.py).
The samples of a prompt share its rows: sample 0 records the prompt's rows (within the window),
the others from the prompt's end on (their own part). Nothing runs yet.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..capture.protocol import RequestTag
from .steering import SteeredRequest

PromptLike = str | list[dict] | dict
#: Which rows a call captures per sample: ``"all"`` (every position), ``"generated"`` (the
#: generated tokens' positions only) or an int k (the last k prompt positions, then the generated ones).
Window = str | int
#: A prompt as vLLM receives it (a prompt dict) and its text (the step-cache key).
Rendered = tuple[Any, str]

#: Capture tags are unique in the process, so generators sharing one engine never collide.
_TAGS = itertools.count()


def next_tag() -> int:
    return next(_TAGS)


@dataclass(slots=True)
class PlannedRequest:
    """Sample ``sample`` of prompt ``prompt_index``, as the call sends it."""

    tag: int
    prompt_index: int
    sample: int
    prompt: str  # the prompt text (the step-cache key)
    vllm_input: Any  # the prompt dict sent (token ids and vLLM cache_salt)
    params: Any  # this request's own SamplingParams (n=1, tagged)
    steering: SteeredRequest  # its steering and cache keys
    start: int = 0  # its capture window's start: the first position whose row the call returns
    record_from: int = 0  # the first position whose row the worker records for it (past the prompt: shared)


@dataclass
class CallPlan:
    """Everything a call sends, in the order it sends it."""

    prompts: list[PromptLike]  # as the caller gave them
    rendered: list[Rendered]  # per prompt; every vLLM input carries ``prompt_token_ids``
    requests: list[PlannedRequest]
    last: bool  # the last token's row is asked for

    def sent_ids(self, prompt_index: int) -> list[int]:
        return self.rendered[prompt_index][0]["prompt_token_ids"]


def render_prompt(tokenizer: Any, prompt: PromptLike, index: int = 0, enable_thinking: bool = False) -> Rendered:
    """vLLM input and the prompt text (the step-cache key) for a string, chat, text or token prompt.
    A prompt dict's ``cache_salt`` (vLLM's) is kept: the call's caches then keep it apart."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"prompt {index} is empty")
        return prompt, prompt
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and "role" in m for m in prompt):
            raise ValueError(f"prompt {index}: a chat must be a non-empty list of role/content dicts")
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=enable_thinking)
        # The template already holds any BOS; token ids keep vLLM from adding it twice.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"prompt_token_ids": ids}, text
    if isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
        salt = {"cache_salt": str(prompt["cache_salt"])} if prompt.get("cache_salt") else {}
        if "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            if not ids:
                raise ValueError(f"prompt {index} has no token ids")
            return {"prompt_token_ids": ids, **salt}, tokenizer.decode(ids)
        text = prompt["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"prompt {index} is empty")
        return {"prompt": text, **salt}, text
    raise TypeError(f"prompt {index}: expected str, chat (list of dicts), TextPrompt or TokensPrompt, "
                    f"got {type(prompt).__name__}")


def pretokenized(tokenizer: Any, rendered: list[Rendered]) -> list[Rendered]:
    """Text prompts as token ids, tokenized once per prompt here as vLLM tokenizes text (the same
    tokenizer, its special tokens added), so vLLM does not tokenize every sample's request again:
    each sample is a request of its own, and at 64 prompts x 4 samples that was ~0.1 s of a 0.9 s
    call on an H100 host (experiments/results/gpu/paired-c3527b5/ablate-*). (The supported vLLMs
    truncate prompts only through ``tokenization_kwargs`` of their own ``generate``, which this
    generator does not take.)"""
    texts = [i for i, (vllm_input, _) in enumerate(rendered)
             if isinstance(vllm_input, str) or "prompt_token_ids" not in vllm_input]
    if not texts:
        return rendered
    ids = tokenizer([rendered[i][1] for i in texts])["input_ids"]
    out = list(rendered)
    for i, prompt_ids in zip(texts, ids):
        salt = {} if isinstance(rendered[i][0], str) else {k: v for k, v in rendered[i][0].items() if k != "prompt"}
        out[i] = ({"prompt_token_ids": list(prompt_ids), **salt}, rendered[i][1])
    return out


def window_start(window: Window, prompt_len: int) -> int:
    """The first position a ``window`` keeps of a sequence whose prompt has ``prompt_len`` tokens."""
    if window == "all":
        return 0
    if window == "generated":
        return prompt_len
    if isinstance(window, int) and not isinstance(window, bool) and window >= 0:
        return max(prompt_len - window, 0)
    raise ValueError(f"window must be 'all', 'generated' or a number k >= 0 of prompt rows, got {window!r}")


def tagged(sp: Any, sample: int, tag: int, start: int = 0) -> Any:
    """A one-sample copy of ``sp`` carrying ``tag``. ``sp`` is already this call's private copy:
    children are shallow copies with their own ``extra_args``, as vLLM makes the children of an
    n>1 request."""
    child = copy.copy(sp)
    child.n = 1
    # vLLM deep-copies every request's params unless told they are the request's own: these are
    # (the caller's object is never sent), and vLLM's updates of the copy assign fields or add the
    # same stop ids to a set the samples share. Accepting 64 x 4 requests took 71.5 ms with the
    # copies, 31.9 without (plain vLLM's 64 n=4 requests: 26.9; CPU machine,
    # experiments/bench/request_adding.py); on a GPU host the adding overlaps the first steps.
    if hasattr(child, "skip_clone"):
        child.skip_clone = True
    if sp.seed is not None:
        child.seed = sp.seed + sample  # what vLLM does for child i of an n>1 request
    child.extra_args = {**(sp.extra_args or {}), **RequestTag(tag, sample, start).to_extra_args()}
    return child


def plan_call(prompts: Sequence[PromptLike], rendered: list[Rendered], params: list[Any], last: bool,
              steer: Callable[[Any, Rendered, int], SteeredRequest], window: Window = "all") -> CallPlan:
    """One request per sample of every prompt; ``steer(params, rendered prompt, index)`` checks a
    prompt's steering and gives its cache keys (before anything runs); ``window``: the rows each
    sample captures (:func:`window_start`, from each prompt's own length)."""
    window_start(window, 0)  # refuse a bad window before anything runs
    requests: list[PlannedRequest] = []
    private: dict[int, Any] = {}  # one deep copy per distinct SamplingParams: the caller's stays untouched
    for i, (rendered_i, sp) in enumerate(zip(rendered, params)):
        if sp.n < 1:
            raise ValueError("SamplingParams.n must be >= 1")
        request = steer(sp, rendered_i, i)
        if id(sp) not in private:
            private[id(sp)] = copy.deepcopy(sp)
        sp = private[id(sp)]
        prompt_len = len(rendered_i[0]["prompt_token_ids"])
        start = window_start(window, prompt_len)
        for s in range(sp.n):
            tag = next_tag()
            own = start if s == 0 else max(start, prompt_len)  # sample 0 holds the prompt rows for all
            child = tagged(sp, s, tag, own)
            child.extra_args.update(request.extra_args)
            requests.append(PlannedRequest(tag, i, s, rendered_i[1], request.vllm_input, child, request, start, own))
    return CallPlan(list(prompts), rendered, requests, last)
