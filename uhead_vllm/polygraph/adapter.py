"""lm-polygraph's vLLM model adapter with the fixes our estimators need.

lm-polygraph 0.7.0's ``WhiteboxModelvLLM`` has four problems on real models:

- its dense log-prob matrices are ``max(tokenizer.vocab_size, max added id)`` wide, one short of
  ``len(tokenizer)`` and far short of a padded config vocabulary (Qwen), while vLLM returns ids up
  to the config vocabulary: an ``IndexError`` on the first such id;
- instruct prompts go through ``llm.chat`` with no ``chat_template_kwargs``, so Qwen3-style
  templates silently run in thinking mode;
- "greedy" calls sample (it copies ``temperature=1, top_k=50`` from the generation parameters and
  ignores ``do_sample``);
- ``generate_texts`` passes its texts positionally and never works.

``UheadWhiteboxModelvLLM`` subclasses it and fixes all four. ``polygraph_eval`` builds the stock
class itself, with no hook for another class, so :func:`upgrade_whitebox` converts that instance in
place; our stat-calculator builders call it, because the builder environment is the only place
that sees the model before the run starts.
"""

from __future__ import annotations

from copy import copy
from pathlib import Path
from typing import Any, Sequence

import torch
from lm_polygraph.model_adapters import WhiteboxModelvLLM
from lm_polygraph.utils.generation_parameters import GenerationParameters
from transformers.generation import GenerateDecoderOnlyOutput

from ..errors import LogprobsMissingError

# The system turn lm-polygraph's adapter hard-codes; kept as the default for compatibility.
LM_POLYGRAPH_SYSTEM_PROMPT = (
    "You are a knowledgeable assistant who answers questions concisely and accurately and "
    "strictly follows output formatting instructions."
)
MODEL_TYPE = "vLLMCausalLM"


def dense_vocab_size(llm: Any) -> int:
    """Width of any dense ``[T, vocab]`` matrix for ``llm``: config vocab or tokenizer, the larger.

    vLLM can return ids up to the config vocabulary (padded embeddings), which may exceed
    ``len(tokenizer)``; the tokenizer can also hold added tokens past the config vocabulary.
    """
    return max(int(llm.model_config.get_vocab_size()), len(llm.get_tokenizer()))


def greedy_sampling_params(sp: Any) -> Any:
    """Copy of ``sp`` that decodes greedily (what HF does when ``do_sample=False``)."""
    out = copy(sp)
    out.temperature = 0.0
    out.top_k = 0
    out.top_p = 1.0
    out.min_p = 0.0
    return out


class UheadWhiteboxModelvLLM(WhiteboxModelvLLM):
    """``WhiteboxModelvLLM`` with a correct vocabulary width, configurable thinking mode, greedy
    decoding when ``do_sample`` is off, and a working ``generate_texts``.

    ``enable_thinking`` reaches the chat template (default off); ``system_prompt=None`` sends no
    system turn (the template's own default applies).
    """

    def __init__(
        self,
        model: Any,
        sampling_params: Any,
        generation_parameters: GenerationParameters | None = None,
        device: str = "cpu",
        instruct: bool = False,
        *,
        enable_thinking: bool = False,
        system_prompt: str | None = LM_POLYGRAPH_SYSTEM_PROMPT,
    ):
        super().__init__(model, sampling_params, generation_parameters or GenerationParameters(), device, instruct)
        self._configure(enable_thinking=enable_thinking, system_prompt=system_prompt)

    def _configure(self, enable_thinking: bool = False, system_prompt: str | None = LM_POLYGRAPH_SYSTEM_PROMPT) -> None:
        if not isinstance(enable_thinking, bool):
            raise TypeError(f"enable_thinking must be true or false, got {enable_thinking!r}")
        self.enable_thinking = enable_thinking
        self.system_prompt = system_prompt
        self.model_type = MODEL_TYPE
        self.model_path = str(self.model.model_config.model)
        self.vocab_size = dense_vocab_size(self.model)

    # ------------------------------------------------------------------ prompts
    def build_chat(self, text: str) -> list[dict[str, str]]:
        """Chat messages for one input text (system turn only if ``system_prompt`` is set)."""
        chat = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        return chat + [{"role": "user", "content": text}]

    def render_chat(self, text: str) -> str:
        """Prompt text the chat template produces for ``text``, with ``enable_thinking`` passed."""
        return self.tokenizer.apply_chat_template(
            self.build_chat(text), tokenize=False, add_generation_prompt=True, enable_thinking=self.enable_thinking
        )

    def prompt_inputs(self, texts: Sequence[str]) -> list[Any]:
        """vLLM inputs for input texts: rendered chat token ids (instruct) or the plain texts.

        Chats are tokenized here, without adding special tokens (the template has them), so the
        capture path and the plain path run exactly the same token ids.
        """
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings, not one string")
        if not self.instruct:
            return list(texts)
        return [
            {"prompt_token_ids": self.tokenizer(self.render_chat(t), add_special_tokens=False).input_ids}
            for t in texts
        ]

    def sampling_params_for(
        self, *, n: int = 1, max_new_tokens: int | None = None, do_sample: bool | None = None
    ) -> Any:
        """Sampling params for one call: greedy unless ``do_sample`` (default: the generation
        parameters' ``do_sample``)."""
        sample = self.generation_parameters.do_sample if do_sample is None else do_sample
        sp = copy(self.sampling_params) if sample else greedy_sampling_params(self.sampling_params)
        sp.n = int(n)
        if max_new_tokens is not None:
            sp.max_tokens = int(max_new_tokens)
        return sp

    # ------------------------------------------------------------------ generation
    def run(self, texts: Sequence[str], sampling_params: Any) -> list[Any]:
        """Raw vLLM ``RequestOutput`` per text."""
        return self.model.generate(self.prompt_inputs(texts), sampling_params, use_tqdm=False)

    def generate(self, *args: Any, **kwargs: Any) -> GenerateDecoderOnlyOutput:
        """HF-style ``generate(input_ids=..., max_new_tokens=..., num_return_sequences=...)``."""
        if args:
            raise TypeError("generate takes keyword arguments only (input_ids=..., ...)")
        if "input_ids" not in kwargs:
            raise TypeError("generate needs input_ids (a tokenized batch, see tokenize())")
        texts = self.tokenizer.batch_decode(kwargs["input_ids"], skip_special_tokens=True)
        sp = self.sampling_params_for(
            n=kwargs.get("num_return_sequences", 1),
            max_new_tokens=kwargs.get("max_new_tokens"),
            do_sample=kwargs.get("do_sample"),
        )
        return self.post_processing(self.run(texts, sp))

    def generate_texts(self, input_texts: list[str], **args: Any) -> list[str]:
        """Texts in prompt-major order (``n`` per prompt), as lm-polygraph's sampling calculators expect."""
        n = args.get("num_return_sequences", args.get("n", 1))
        sp = self.sampling_params_for(n=n, max_new_tokens=args.get("max_new_tokens"), do_sample=args.get("do_sample"))
        return [c.text for ro in self.run(input_texts, sp) for c in ro.outputs]

    def post_processing(self, outputs: Sequence[Any]) -> GenerateDecoderOnlyOutput:
        """Dense ``[max_len, vocab]`` log-prob rows (top-k filled, rest -inf) per sample.

        Same layout as lm-polygraph's adapter (sequences padded with EOS, rows past a sample's end
        are all -inf), but ``vocab`` is :func:`dense_vocab_size`.
        """
        samples = [c for ro in outputs for c in ro.outputs]
        if not samples:
            raise ValueError("vLLM returned no samples")
        max_len = max(len(c.token_ids) for c in samples)
        eos = self.tokenizer.eos_token_id
        logits, sequences = [], []
        for c in samples:
            rows = logprob_rows(c, self.vocab_size)
            dense = torch.full((max_len, self.vocab_size), -torch.inf)
            dense[: rows.shape[0]] = rows
            seq = torch.full((max_len,), eos, dtype=torch.long)
            seq[: len(c.token_ids)] = torch.tensor(list(c.token_ids), dtype=torch.long)
            logits.append(dense)
            sequences.append(seq)
        return GenerateDecoderOnlyOutput(sequences=sequences, logits=logits, scores=logits)


def logprob_rows(sample: Any, vocab_size: int) -> torch.Tensor:
    """``[T, vocab_size]`` float32 rows of one vLLM ``CompletionOutput``: its returned top-k
    log-probs, -inf elsewhere (absent means "not returned", never "probability 0")."""
    if sample.logprobs is None:
        raise LogprobsMissingError(
            "vLLM returned no logprobs; build SamplingParams with logprobs=k (model.logprobs in the "
            "polygraph_eval config)"
        )
    if len(sample.logprobs) != len(sample.token_ids):
        raise ValueError(f"{len(sample.logprobs)} logprob rows for {len(sample.token_ids)} tokens")
    rows = torch.full((len(sample.token_ids), vocab_size), -torch.inf)
    for t, entry in enumerate(sample.logprobs):
        ids = torch.tensor(list(entry.keys()), dtype=torch.long)
        if len(ids) and int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} >= vocabulary width {vocab_size}")
        rows[t, ids] = torch.tensor([lp.logprob for lp in entry.values()], dtype=torch.float32)
    return rows


def upgrade_whitebox(model: Any, **settings: Any) -> UheadWhiteboxModelvLLM:
    """Turn lm-polygraph's ``WhiteboxModelvLLM`` instance into :class:`UheadWhiteboxModelvLLM`
    in place (same LLM, sampling params, generation parameters, ``instruct`` flag) and apply
    ``settings`` (``enable_thinking``, ``system_prompt``).

    In place, because every stat calculator and estimator of a ``polygraph_eval`` run receives
    that one instance. An instance that is already upgraded is reconfigured only if settings are
    given.
    """
    if isinstance(model, UheadWhiteboxModelvLLM):
        if settings:
            model._configure(**settings)
        return model
    if type(model) is not WhiteboxModelvLLM:
        raise TypeError(
            f"expected lm-polygraph's WhiteboxModelvLLM (model.type: vLLMCausalLM in the config), "
            f"got {type(model).__name__}"
        )
    model.__class__ = UheadWhiteboxModelvLLM
    model._configure(**settings)
    return model


def model_folder(model: Any) -> Path | None:
    """Local folder of the served model, or None if vLLM was given a hub name."""
    llm = getattr(model, "model", model)
    path = Path(str(llm.model_config.model))
    return path if (path / "config.json").is_file() else None
