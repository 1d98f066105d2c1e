"""Common contract of uncertainty heads: fit / predict_proba / score, safe save and checked load.

A head is only meaningful on hidden states of the model (and layers, and feature recipe) it was
trained on. Loading therefore compares what was saved with what the caller expects and refuses a
mismatch loudly instead of producing plausible-looking nonsense. Storage is ``config.json`` (all
metadata, human readable) + ``weights.safetensors`` (plain tensors; never pickle).

How a head is applied (:class:`HeadUsage`: how its answers are generated and cut into steps, what
it learnt from, how an answer's P(wrong) is derived) is part of the head's config (``usage``);
every consumer (main job, server, lm-polygraph estimators, study evaluation) reads it from there.
Every head class registers itself under its ``head_type`` (and short ``aliases``) in the one
registry of head classes (:func:`head_class`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .. import envs
from ..envs import ALLOW_OTHER_WEIGHTS_ENV
from ..errors import HeadFormatError, HeadMismatchError
from ..features import FeatureRecipe

if TYPE_CHECKING:
    from .token_inputs import TokenInputs

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
#: 2: ``usage`` in config.json (version-1 heads kept it in ``training["study"]``; still read).
FORMAT_VERSION = 2
IDENTITY_KEYS: tuple[str, ...] = ("name", "architecture", "hidden_size", "num_hidden_layers")
FINGERPRINT_KEY = "weights_fingerprint"

H = TypeVar("H", bound="UncertaintyHead")
StepsLike = Sequence[torch.Tensor | np.ndarray]


HEAD_LEVELS: tuple[str, ...] = ("step", "answer", "joint")
ANSWER_SCORING: tuple[str, ...] = ("span", "max_step")


@dataclass(frozen=True)
class HeadUsage:
    """How a head is applied; saved as ``usage`` in the head's ``config.json``.

    ``level``: what the head learnt from (``step``: labelled steps; ``answer``: whole answers;
    ``joint``: both). ``answer_scoring``: how an answer's P(wrong) is derived (``span``: the head on
    the whole answer; ``max_step``: its most doubtful step). ``generation``: how the answers it was
    trained on were produced and cut into steps (the fields of
    :class:`uhead_vllm.scoring.recipe.GenerationRecipe`: prompt style, max_tokens, temperature,
    logprobs, split_mode, seed); None for a head trained on answers produced otherwise.
    """

    level: str
    answer_scoring: str
    generation: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.level not in HEAD_LEVELS:
            raise ValueError(f"unknown level {self.level!r}; expected one of {HEAD_LEVELS}")
        if self.answer_scoring not in ANSWER_SCORING:
            raise ValueError(f"unknown answer scoring rule {self.answer_scoring!r}; expected one of {ANSWER_SCORING}")

    @classmethod
    def for_level(cls, level: str, generation: dict[str, Any] | None = None) -> "HeadUsage":
        """The usage of a head trained at ``level``: a step head scores an answer by its worst
        step (``max_step``), an answer or joint head by the whole answer (``span``)."""
        return cls(level, "max_step" if level == "step" else "span", generation)

    @classmethod
    def from_config(cls, usage: dict[str, Any] | None, training: dict[str, Any]) -> "HeadUsage | None":
        """``usage`` as saved; for heads saved before it existed (format 1), what training
        recorded: ``training["study"]`` (``uhead-vllm train``) or a plain ``training["level"]``."""
        if usage:
            return cls(**usage)
        study = training.get("study") or {}
        level = study.get("level") or training.get("level")
        if level == "sequence":  # lm-polygraph's name for a whole answer
            level = "answer"
        if level not in HEAD_LEVELS:
            return None
        default = cls.for_level(level, study.get("generation"))
        return cls(level, study.get("answer_scoring", default.answer_scoring), default.generation)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HeadConfig:
    """Everything about a head except its weights; saved as ``config.json``."""

    head_type: str
    n_features: int
    model_identity: dict[str, Any] | None = None
    layers: list[int] | None = None
    recipe: dict[str, Any] | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, Any] | None = None  # HeadUsage.to_dict(); absent in format-1 heads
    format_version: int = FORMAT_VERSION

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "HeadConfig":
        """Read ``config.json``; :class:`HeadFormatError` names the folder if it is damaged."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise HeadFormatError(path.parent, f"{path.name} is missing") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise HeadFormatError(path.parent, f"{path.name} is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise HeadFormatError(path.parent, f"{path.name} holds a {type(data).__name__}, not an object")
        version = data.get("format_version", FORMAT_VERSION)
        if version > FORMAT_VERSION:
            raise HeadMismatchError(f"{path}: format_version {version} is newer than supported {FORMAT_VERSION}")
        try:
            return cls(**data)
        except TypeError as exc:  # missing or unknown keys
            raise HeadFormatError(path.parent, f"{path.name} does not describe a head ({exc})") from None


def identity_from_hf_config(name: str, hf_config: Any) -> dict[str, Any]:
    """Build a ``model_identity`` dict from a HF config (uses ``text_config`` for multimodal models)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    archs = getattr(hf_config, "architectures", None) or [type(hf_config).__name__]
    return {
        "name": name,
        "architecture": archs[0],
        "hidden_size": int(text.hidden_size),
        "num_hidden_layers": int(text.num_hidden_layers),
    }


def check_weights(saved_id: dict[str, Any], expect_id: dict[str, Any], allow_other_weights: bool = False) -> None:
    """Refuse a head trained on other weights than the model's (same name and shapes, e.g. a
    fine-tune): its hidden states differ, so the head's scores would be plausible nonsense.

    Checked only when both sides carry a fingerprint key (heads saved before fingerprints existed
    have none and are accepted). ``allow_other_weights`` or ``$UHEAD_VLLM_ALLOW_OTHER_WEIGHTS=1``
    skips the check, for people who know the head transfers.
    """
    have = saved_id.get(FINGERPRINT_KEY)
    if not have or FINGERPRINT_KEY not in expect_id:
        return
    if allow_other_weights or envs.allow_other_weights():
        return
    want = expect_id[FINGERPRINT_KEY]
    override = (f"pass allow_other_weights=True (CLI: --allow-other-weights; or set "
                f"{ALLOW_OTHER_WEIGHTS_ENV}=1) only if you know the head transfers")
    if want is None:
        raise HeadMismatchError(
            f"head was trained on weights {have} of {saved_id.get('name')!r}, but the model's weights "
            f"cannot be fingerprinted (no .safetensors files); {override}"
        )
    if want != have:
        raise HeadMismatchError(
            f"head was trained on other weights of model {saved_id.get('name')!r} (fingerprint {have}, "
            f"this model's is {want}): a fine-tune or another checkpoint under the same name and "
            f"shapes gives other hidden states. Use a head trained on these weights, or {override}"
        )


def check_compatible(
    config: HeadConfig,
    expect_model_identity: dict[str, Any] | None = None,
    expect_layers: Sequence[int] | None = None,
    allow_other_weights: bool = False,
) -> None:
    """Raise :class:`HeadMismatchError` naming saved vs expected values on any disagreement."""
    saved_id = config.model_identity or {}
    if expect_model_identity is not None:
        for key in IDENTITY_KEYS:
            if key not in expect_model_identity:
                continue
            want, have = expect_model_identity[key], saved_id.get(key)
            if have != want:
                raise HeadMismatchError(
                    f"head was trained for model {key}={have!r} but expected {key}={want!r}"
                )
        check_weights(saved_id, expect_model_identity, allow_other_weights)
    if expect_layers is not None and (config.layers is None or list(config.layers) != [int(x) for x in expect_layers]):
        raise HeadMismatchError(f"head was trained on layers {config.layers} but expected layers {list(expect_layers)}")
    # Feature size implied by recipe and hidden size must be what the weights take.
    hidden = (expect_model_identity or {}).get("hidden_size", saved_id.get("hidden_size"))
    if config.recipe is not None and hidden is not None:
        implied = FeatureRecipe.from_dict(config.recipe).token_dim(int(hidden))
        if implied != config.n_features:
            raise HeadMismatchError(
                f"head takes {config.n_features} features per token but recipe {config.recipe} with "
                f"hidden_size={hidden} gives {implied}"
            )


def check_labels(labels: Any, n: int) -> np.ndarray:
    """Labels as int array of 0/1 (1 = wrong) with both classes present."""
    y = np.asarray(labels)
    if y.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {y.shape}")
    if not np.isin(y, (0, 1)).all():
        raise ValueError("labels must be 0 (correct) or 1 (wrong)")
    y = y.astype(np.int64)
    if y.min() == y.max():
        raise ValueError(f"labels contain one class only ({int(y[0])}); a head needs both")
    return y


#: The one registry of head classes: ``head_type`` (as saved in config.json) -> class. Filled by
#: ``UncertaintyHead.__init_subclass__``; read through :func:`head_class`.
_REGISTRY: dict[str, type["UncertaintyHead"]] = {}


def head_class(name: str) -> type["UncertaintyHead"]:
    """The head class registered as ``name``: its ``head_type`` (``linear_probe``,
    ``attention_pooling``) or one of its short ``aliases`` (``linear``, ``attention``)."""
    for cls in _REGISTRY.values():
        if name == cls.head_type or name in cls.aliases:
            return cls
    raise HeadMismatchError(f"unknown head type {name!r}; known: {head_names(aliases=False)} "
                            f"(short names: {head_names()})")


def head_names(aliases: bool = True) -> list[str]:
    """Registered head names: the short aliases (for command lines) or the saved ``head_type``s."""
    if not aliases:
        return sorted(_REGISTRY)
    return sorted(a for cls in _REGISTRY.values() for a in cls.aliases)


class UncertaintyHead(ABC):
    """Base of all heads: scikit-learn style (constructor-only hyper-parameters, ``_``-suffixed
    learned attributes), inputs are lists of per-token step matrices ``[t, F]``.

    ``predict_proba`` returns P(wrong) = uncertainty; ``score`` returns validity = 1 - P(wrong)
    (unlike scikit-learn's ``score``, which is accuracy: consumers want a per-step validity).
    ``usage`` (:class:`HeadUsage`, None if unknown) says how the head is applied; trainers set it.
    """

    head_type: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    _param_names: ClassVar[tuple[str, ...]] = ()
    #: Learned attributes, set by ``fit`` or ``load`` (absent before: ``_check_fitted`` asks for them).
    n_features_in_: int
    training_summary_: dict[str, Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "head_type" in cls.__dict__:
            _REGISTRY[cls.head_type] = cls

    def __init__(self, recipe: FeatureRecipe | dict[str, Any] | None = None, model_identity: dict[str, Any] | None = None):
        self.recipe = FeatureRecipe.from_dict(recipe) if isinstance(recipe, dict) else recipe
        self.model_identity = dict(model_identity) if model_identity is not None else None
        self.usage: HeadUsage | None = None

    def require_usage(self, generation: bool = False) -> HeadUsage:
        """:attr:`usage`, or a ValueError saying the head does not record it (``generation``:
        the answers' generation recipe is needed too, e.g. to prompt like the training data)."""
        if self.usage is None or (generation and self.usage.generation is None):
            what = "generation recipe (prompt style, step splitting)" if self.usage is not None else "usage"
            raise ValueError(f"this head records no {what} (was it trained with `uhead-vllm train`?)")
        return self.usage

    # --- subclass contract ---------------------------------------------------------------------

    @abstractmethod
    def fit(self: H, steps: StepsLike, labels: Any) -> H:
        """Train on steps (``[t, F]`` each) with labels 1 = wrong, 0 = correct."""

    @abstractmethod
    def predict_proba(self, steps: StepsLike) -> np.ndarray:
        """P(step is wrong) per step, shape ``[n]``."""

    @abstractmethod
    def _weights(self) -> dict[str, torch.Tensor]:
        """Learned state as named plain tensors."""

    @abstractmethod
    def _set_weights(self, weights: dict[str, torch.Tensor], n_features: int) -> None:
        """Restore learned state; raise HeadMismatchError if shapes disagree with ``n_features``."""

    def token_inputs(self) -> "TokenInputs":
        """The linear map this head applies to a token's hidden-state features, to run where the
        rows are (heads/token_inputs.py); a head type without one raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} does not reduce its inputs per token")

    # --- shared behaviour ----------------------------------------------------------------------

    def _reads(self) -> tuple[tuple[int, ...], int]:
        """(recipe layers, logprob_topk): which features this fitted head reads."""
        self._check_fitted()
        if self.recipe is None:
            raise ValueError("this head has no feature recipe, so which rows it reads is unknown")
        return tuple(self.recipe.layers), self.recipe.logprob_topk

    def score(self, steps: StepsLike) -> np.ndarray:
        """Validity per step, 1 - P(wrong)."""
        return 1.0 - self.predict_proba(steps)

    def get_params(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._param_names}

    def _check_fitted(self) -> None:
        if not hasattr(self, "n_features_in_"):
            raise RuntimeError(f"{type(self).__name__} is not fitted; call fit() or load()")

    def _as_steps(self, steps: StepsLike, fitting: bool = False) -> list[torch.Tensor]:
        """Validate steps: non-empty float32 ``[t, F]`` matrices with one F (the fitted one)."""
        if not fitting:
            self._check_fitted()
        out = [torch.as_tensor(s).to(torch.float32) for s in steps]
        if not out:
            raise ValueError("no steps given")
        want = None if fitting else self.n_features_in_
        for i, s in enumerate(out):
            if s.dim() != 2 or s.shape[0] == 0:
                raise ValueError(f"step {i} must be a non-empty [t, F] matrix, got shape {tuple(s.shape)}")
            want = s.shape[1] if want is None else want
            if s.shape[1] != want:
                raise ValueError(f"step {i} has {s.shape[1]} features, expected {want}")
        return out

    def config(self) -> HeadConfig:
        self._check_fitted()
        return HeadConfig(
            head_type=self.head_type,
            n_features=int(self.n_features_in_),
            model_identity=self.model_identity,
            layers=list(self.recipe.layers) if self.recipe else None,
            recipe=self.recipe.to_dict() if self.recipe else None,
            hyperparameters=self.get_params(),
            training=dict(getattr(self, "training_summary_", {})),
            usage=self.usage.to_dict() if self.usage is not None else None,
        )

    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` + ``weights.safetensors`` into ``directory`` (created if needed)."""
        config = self.config()
        check_compatible(config)  # refuse to write a head whose recipe contradicts its feature size
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().cpu().contiguous().clone() for k, v in self._weights().items()}
        save_file(weights, str(out / WEIGHTS_FILE), metadata={"head_type": self.head_type})
        config.save(out / CONFIG_FILE)
        return out

    @classmethod
    def load(
        cls: type[H],
        directory: str | Path,
        expect_model_identity: dict[str, Any] | None = None,
        expect_layers: Sequence[int] | None = None,
        allow_other_weights: bool = False,
    ) -> H:
        """Load a saved head, verifying model identity (weights fingerprint included, see
        :func:`check_weights`), layers and feature size; dispatches on the saved head type when
        called on the base class."""
        path = Path(directory)
        config = HeadConfig.load(path / CONFIG_FILE)
        head_cls = _REGISTRY.get(config.head_type)
        if head_cls is None:
            raise HeadMismatchError(f"unknown head type {config.head_type!r}; known: {head_names(aliases=False)}")
        if not issubclass(head_cls, cls):
            raise HeadMismatchError(f"{path} holds a {config.head_type!r} head, not a {cls.__name__}")
        check_compatible(config, expect_model_identity, expect_layers, allow_other_weights)
        try:
            head = head_cls(recipe=config.recipe, model_identity=config.model_identity, **config.hyperparameters)
        except TypeError as exc:
            raise HeadFormatError(path, f"{CONFIG_FILE} has hyperparameters {head_cls.__name__} does not take ({exc})") from None
        weights_path = path / WEIGHTS_FILE
        if not weights_path.is_file():
            raise HeadFormatError(path, f"{WEIGHTS_FILE} is missing")
        try:
            weights = load_file(str(weights_path))
        except Exception as exc:  # safetensors raises its own SafetensorError (and OSError)
            raise HeadFormatError(path, f"{WEIGHTS_FILE} cannot be read ({type(exc).__name__}: {exc})") from None
        try:
            head._set_weights(weights, config.n_features)
        except (KeyError, RuntimeError) as exc:  # a tensor missing, extra or of the wrong shape
            raise HeadFormatError(path, f"{WEIGHTS_FILE} does not hold this head's tensors ({exc})") from None
        head.n_features_in_ = config.n_features
        head.training_summary_ = dict(config.training)
        try:
            head.usage = HeadUsage.from_config(config.usage, config.training)
        except (TypeError, ValueError) as exc:
            raise HeadFormatError(path, f"{CONFIG_FILE} has an invalid usage ({exc})") from None
        return head  # type: ignore[return-value]
