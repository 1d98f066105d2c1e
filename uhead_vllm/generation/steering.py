"""Engine side of steering: check a request's ``uhead_steer`` spec before anything runs, and give
the request the cache keys that keep steered and plain states apart.

A steered request computes other keys, values and rows for the same tokens, so it gets vLLM's
``cache_salt`` = the digest of its resolved spec (``"generated"`` replaced by the prompt length,
so a recompute of the whole sequence as a prompt steers the same positions), and the row store
keys its rows by the same digest. The step cache is keyed by the spec as given: the next step
of a ``"generated"`` trajectory has a longer prompt (another resolved spec) and must still find
its parent. Unsteered requests get one fixed salt, :data:`CAPTURE_CACHE_SALT`, so vLLM never
serves them blocks that uncaptured requests on the same engine computed. A prompt's own
``cache_salt`` (a client's, as vLLM's isolation between clients) goes in front of either salt, and
the row store and the step cache key by it too, so no client ever gets rows of another salt (nor
an unsalted request salted ones). See docs/capture_points.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..capture.steering import STEER_KEY, SteerSpec, SteerSpecError
from ..errors import SteeringError


#: vLLM ``cache_salt`` of every unsteered request the generator sends. Captured requests then
#: reuse only KV blocks that captured requests computed, whose rows were recorded (and are in the
#: row store or shared during the pass); blocks that a plain ``llm.generate`` on the same engine
#: left in vLLM's prefix cache have rows nowhere, and hitting them cost a second pass over every
#: sequence (the value study's 4000-sequence steps after its plain baselines: 320k rows, minutes).
CAPTURE_CACHE_SALT = "uhead-capture"


def with_cache_salt(vllm_input: Any, salt: str) -> dict:
    """``vllm_input`` (a text prompt or a prompt dict) as a prompt dict with ``cache_salt``."""
    base = {"prompt": vllm_input} if isinstance(vllm_input, str) else dict(vllm_input)
    return {**base, "cache_salt": salt}


@dataclass(frozen=True)
class SteeredRequest:
    """What the generator sends for one prompt, and the keys its rows are cached under."""

    vllm_input: Any  # a prompt dict with vLLM's cache_salt
    salt: str = ""  # row-store key prefix: the vLLM cache_salt, "" for a plain unsalted request
    extra_args: dict = field(default_factory=dict)  # the resolved spec, merged into each child's extra_args
    step_salt: str = ""  # step-cache key prefix ("" = plain unsalted)

    @property
    def cache_salt(self) -> str:
        """vLLM's ``cache_salt`` of the request (a recompute of its rows is sent with it too)."""
        return self.vllm_input["cache_salt"]


def salted(client_salt: str, salt: str) -> str:
    """``salt`` inside the namespace of a client's own ``cache_salt`` (as the server salts)."""
    return f"{client_salt}:{salt}" if client_salt else salt


def steer_request(extra_args: dict | None, vllm_input: Any, text: str, *, index: int, engine_steers: bool,
                  num_layers: int, hidden_size: int, tokenize: Callable[[str], list[int]]) -> SteeredRequest:
    """The request of prompt ``index`` (``vllm_input`` as rendered, with the client's
    ``cache_salt`` if it has one; ``text`` its prompt text); ``SteeringError`` for a bad spec or
    an engine built without ``steering=True``."""
    try:
        spec = SteerSpec.from_extra_args(extra_args)
        if spec is not None and engine_steers:
            spec.check(num_layers, hidden_size)
    except SteerSpecError as exc:
        raise SteeringError(f"prompt {index}: {exc}") from None
    client = str(vllm_input.get("cache_salt") or "") if isinstance(vllm_input, dict) else ""
    if spec is None:
        if not client:
            return SteeredRequest(with_cache_salt(vllm_input, CAPTURE_CACHE_SALT))
        salt = salted(client, CAPTURE_CACHE_SALT)
        return SteeredRequest(with_cache_salt(vllm_input, salt), salt, step_salt=f"{client}:")
    if not engine_steers:
        raise SteeringError(f"prompt {index} asks for steering ('{STEER_KEY}'), but this engine was built "
                            "without it: build_llm(..., steering=True, enforce_eager=True)")
    if not isinstance(vllm_input, dict) or "prompt_token_ids" not in vllm_input:
        # token ids, so "generated" starts where vLLM's prompt ends
        vllm_input = {"prompt_token_ids": tokenize(text), **({"cache_salt": client} if client else {})}
    resolved = spec.resolved(len(vllm_input["prompt_token_ids"]))
    salt = salted(client, resolved.digest())
    return SteeredRequest(with_cache_salt(vllm_input, salt), salt, resolved.to_extra_args(),
                          salted(client, spec.digest()))


def step_key(prompt: str, step_salt: str) -> str:
    """Step-cache key: the prompt text, behind the steering digest and the client's cache salt
    (so a steered or salted candidate never continues a plain or otherwise salted trajectory of the
    same text, or the reverse)."""
    return f"\x00uhead-steer:{step_salt}\x00{prompt}" if step_salt else prompt


__all__ = ["CAPTURE_CACHE_SALT", "SteeredRequest", "SteeringError", "salted", "steer_request", "step_key",
           "with_cache_salt"]
