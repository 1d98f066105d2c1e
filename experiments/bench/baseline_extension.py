"""The common approach to hidden-state capture in vLLM, rebuilt only to measure what it costs.

What it does (the pattern of widely used worker extensions): forward hooks on decoder layers, so the
engine must run in eager mode (hooks on compiled submodules never fire); every forward, each
tagged layer's output is cut per request and converted to a float32 numpy array; on fetch the
per-request, per-layer arrays are pickled and returned through ``collective_rpc``.

Two deliberate departures, both in the baseline's favour or neutral for cost:
- The widely used extension keeps only the first element of the decoder layer's ``(hidden,
  residual)`` output, i.e. the MLP delta, which is not the hidden state (see DESIGN.md). For a fair
  cost comparison this baseline sums ``hidden + residual`` as ``uhead_vllm`` does.
- The benchmark runs the engine in-process, so the pickled bytes never cross a process boundary;
  the pickle/unpickle cost is still paid. Unpickling is refused unless the engine is in-process:
  the bytes are then produced by this very process (the project never unpickles data from another
  process).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

EXTENSION_QUALNAME = "experiments.bench.baseline_extension.CommonApproachExtension"


class CommonApproachExtension:
    """Mixed into the vLLM worker; call ``bl_install`` once after load, ``bl_fetch`` after generate."""

    def bl_install(self, layers: list[int]) -> int:
        """Register one forward hook per requested HF hidden-state index; returns hooks installed."""
        runner = self.model_runner
        decoder = runner.model.model
        self._bl_rows: dict[str, dict[int, list[np.ndarray]]] = {}
        self._bl_layers = [int(k) for k in layers]
        handles = []
        for k in self._bl_layers:
            if k == 0:
                module = decoder.embed_tokens
            elif 1 <= k <= len(decoder.layers):
                module = decoder.layers[k - 1]
            else:
                raise ValueError(f"layer {k} out of range 0..{len(decoder.layers)}")
            handles.append(module.register_forward_hook(self._bl_make_hook(k)))
        self._bl_handles = handles
        return len(handles)

    def _bl_make_hook(self, k: int):
        runner = self.model_runner

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            n = int(runner.input_batch.num_reqs)
            if n == 0:
                return  # profile / warm-up dummy forward
            hidden = output[0] + output[1] if isinstance(output, tuple) else output
            req_ids = runner.input_batch.req_ids[:n]
            qsl = runner.query_start_loc.cpu[: n + 1].tolist()
            for rid, a, b in zip(req_ids, qsl[:-1], qsl[1:]):
                if b <= a:
                    continue
                part = hidden[a:b]
                host = part.float().cpu()  # on a GPU: a synchronous copy per request and layer
                arr = host.numpy()
                if host.data_ptr() == part.data_ptr():
                    arr = arr.copy()  # CPU fp32: .float().cpu() was a no-op; detach from the buffer
                self._bl_rows.setdefault(rid, {}).setdefault(k, []).append(arr)

        return hook

    def bl_fetch(self) -> bytes:
        """Pickled ``{request_id: {layer: float32 array [rows, H]}}`` of everything recorded."""
        out = {
            rid: {k: np.concatenate(chunks) for k, chunks in per_layer.items()}
            for rid, per_layer in self._bl_rows.items()
        }
        self._bl_rows = {}
        return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)


def engine_kwargs() -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``: the baseline extension, eager mode (hooks need it)."""
    return {"worker_extension_cls": EXTENSION_QUALNAME, "enforce_eager": True}


def install(llm: Any, layers: list[int]) -> None:
    n = llm.collective_rpc("bl_install", args=(list(layers),))
    if not n or n[0] != len(layers):
        raise RuntimeError(f"baseline hooks not installed: {n}")


def fetch(llm: Any, layers: list[int]) -> tuple[dict[str, torch.Tensor], int]:
    """Per-request ``[rows, L, H]`` float32 tensors (the engine-side half) and the pickle size."""
    from .env import in_process_engine

    if not in_process_engine():
        raise RuntimeError(
            "the common-approach baseline unpickles its payload; it only runs with an in-process "
            "engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), where the bytes come from this process"
        )
    payloads = llm.collective_rpc("bl_fetch")
    if len(payloads) != 1 or not isinstance(payloads[0], bytes):
        raise RuntimeError("expected one pickled payload from the in-process worker")
    data = pickle.loads(payloads[0])  # produced by this process (checked above)
    per_request = {
        rid: torch.from_numpy(np.stack([per_layer[k] for k in layers], axis=1))
        for rid, per_layer in data.items()
    }
    return per_request, len(payloads[0])
