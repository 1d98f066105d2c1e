"""KV connector for vLLM's ``extract_hidden_states`` speculative method that works on CPU.

vLLM's ``ExampleHiddenStatesConnector`` copies each finished request's hidden states out of the
hidden-state KV cache with CUDA streams, events and pinned memory, so it fails on CPU. This
subclass writes synchronously instead, inside the worker's ``get_finished`` call, and only for
requests that carry a uhead capture tag (untagged requests are neither delayed nor written).

Files, one per tagged request, in ``shared_storage_path``:
- ``uhead-{tag}-{sample}.pending``: created when the request is first scheduled, removed once its
  result is on disk. The engine side waits while any marker is left.
- ``uhead-{tag}-{sample}.safetensors``: ``hidden_states [T, L, H]`` (aux layer ids in ascending
  order, model dtype) and ``token_ids [T]`` for positions ``0..T-1``: the prompt and every generated
  token but the last, which vLLM never forwards. Written to a temporary name first, then renamed.
- ``uhead-{tag}-{sample}.error``: text, written instead when extraction or the write fails.

Load it with ``kv_transfer_config={"kv_connector": CONNECTOR_NAME, "kv_connector_module_path":
CONNECTOR_MODULE, ...}`` (``uhead_vllm.generation.backends.extract.extract_engine_kwargs``).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

from .protocol import RequestTag
from ..adapters.cpu_repairs import repair_cpu_seeded_prefill, repair_cpu_spec_sampling

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

CONNECTOR_NAME = "UheadHiddenStatesConnector"
CONNECTOR_MODULE = "uhead_vllm.capture.extract_connector"
FILE_PREFIX = "uhead-"
DATA_SUFFIX = ".safetensors"
PENDING_SUFFIX = ".pending"
ERROR_SUFFIX = ".error"


def request_stem(tag: RequestTag) -> str:
    """File name stem (no directory, no suffix) of a tagged request's result."""
    return f"{FILE_PREFIX}{tag.tag}-{tag.sample}"


def parse_stem(stem: str) -> RequestTag:
    """Inverse of :func:`request_stem`; raises ValueError on foreign names."""
    if not stem.startswith(FILE_PREFIX):
        raise ValueError(f"not a uhead result name: {stem!r}")
    tag, sample = stem[len(FILE_PREFIX):].split("-")
    return RequestTag(int(tag), int(sample))


class UheadHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Store-only connector: synchronous safetensors writes, named by the request's capture tag."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._written: set[str] = set()  # worker side: written, not yet reported finished
        self._check_layers()

    def _check_layers(self) -> None:
        """Fail at engine construction on layer ids the model cannot emit.

        vLLM itself does not check: an id past the last layer is never emitted, the proposer's
        ``[T, L, H]`` buffer is filled by broadcasting the fewer aux tensors, and the file would
        silently hold another layer's rows.
        """
        spec = self._vllm_config.speculative_config.draft_model_config.hf_config
        ids = list(getattr(spec, "eagle_aux_hidden_state_layer_ids", None) or [])
        n = int(self._vllm_config.model_config.get_total_num_hidden_layers())
        bad = [k for k in ids if not isinstance(k, int) or k < 0 or k > n]
        if not ids or bad or len(set(ids)) != len(ids):
            raise ValueError(
                f"extract_hidden_states layer ids {ids} invalid for a model with {n} decoder layers: "
                f"use distinct Hugging Face hidden-state indices 0..{n} (0 = embeddings, {n} = after "
                "the last layer, before the final norm)")

    # ------------------------------------------------------------------ scheduler side
    def build_connector_meta(
        self, scheduler_output: "SchedulerOutput"
    ) -> ExampleHiddenStatesConnectorMetadata:
        """Name the result file of every newly scheduled tagged request (the worker creates markers)."""
        meta = ExampleHiddenStatesConnectorMetadata()
        meta.pending_saves = list(self._pending_saves.values())
        self._pending_saves.clear()
        for new_req in scheduler_output.scheduled_new_reqs:
            sp = new_req.sampling_params
            try:
                tag = RequestTag.from_extra_args(sp.extra_args if sp is not None else None)
            except ValueError:  # a forged or damaged tag: the request runs untagged (never stop the engine)
                continue
            if tag is None:
                continue
            filename = os.path.join(self._storage_path, request_stem(tag) + DATA_SUFFIX)
            other = next((r for r, f in self._request_filenames.items() if f == filename), None)
            if other is not None and other != new_req.req_id:
                # e.g. a parent n>1 request: its children share extra_args, hence the tag.
                with open(_error_path(filename), "w") as f:
                    f.write(f"requests {other!r} and {new_req.req_id!r} carry the same capture tag "
                            f"{(tag.tag, tag.sample)}: sampling with n>1 must go through "
                            "VllmHiddenStatesGenerator, which gives every sample its own tag")
                continue
            self._request_filenames[new_req.req_id] = filename
            meta.new_req_filenames[new_req.req_id] = filename
        return meta

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks of a finished tagged request until its rows are written.

        Saves every position whose input was forwarded: the prompt and all generated tokens but
        the last (capped by ``num_computed_tokens`` for requests aborted mid-prefill).
        """
        filename = self._request_filenames.pop(request.request_id, None)
        if filename is None:
            self._pending_saves.pop(request.request_id, None)
            return False, None
        all_ids = list(request.all_token_ids)
        n = max(0, min(len(all_ids) - 1, int(request.num_computed_tokens)))
        self._pending_saves[request.request_id] = PendingSave(
            req_id=request.request_id, filename=filename,
            token_ids=torch.tensor(all_ids[:n], dtype=torch.int64), block_ids=list(block_ids),
        )
        return True, {"hidden_states_path": filename}

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        repair_cpu_spec_sampling()  # the worker is fully initialised here, sampling not yet started
        repair_cpu_seeded_prefill()

    def wait_for_save(self) -> None:
        """Create the ``.pending`` marker of each new tagged request before its output is returned."""
        if not self._is_tp_rank_zero or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, ExampleHiddenStatesConnectorMetadata):
            return
        for filename in meta.new_req_filenames.values():
            os.makedirs(os.path.dirname(filename), exist_ok=True)
            with open(_marker(filename), "w"):
                pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Write the pending saves handed over by the scheduler; report them done once finished."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = self._accumulated_finished_req_ids & self._written
        self._accumulated_finished_req_ids -= done
        self._written -= done
        return done or None, None

    def _write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        try:
            if self._kv_cache is None:
                raise RuntimeError("hidden-state cache was never registered")
            blocks = torch.tensor(pending.block_ids, dtype=torch.int64)
            slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
            n = int(pending.token_ids.shape[0])
            if n > slots.numel():
                raise RuntimeError(f"{n} positions but only {slots.numel()} cache slots")
            hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n)
            tensors = {"hidden_states": hidden.cpu().contiguous(),
                       "token_ids": pending.token_ids.to(torch.int64).contiguous()}
            tmp = pending.filename + ".tmp"
            save_file(tensors, tmp, metadata={"req_id": pending.req_id,
                                              "num_hidden_states": json.dumps(self.num_hidden_states)})
            os.replace(tmp, pending.filename)
        except Exception as exc:  # never crash the engine: the engine side raises on .error files
            logger.error("uhead hidden-state write failed for %s: %r", pending.req_id, exc)
            with open(_error_path(pending.filename), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
        finally:
            marker = _marker(pending.filename)
            if os.path.exists(marker):
                os.remove(marker)
        self._written.add(pending.req_id)


def _marker(filename: str) -> str:
    return filename[: -len(DATA_SUFFIX)] + PENDING_SUFFIX


def _error_path(filename: str) -> str:
    return filename[: -len(DATA_SUFFIX)] + ERROR_SUFFIX


__all__ = ["CONNECTOR_NAME", "CONNECTOR_MODULE", "UheadHiddenStatesConnector", "request_stem",
           "parse_stem", "DATA_SUFFIX", "PENDING_SUFFIX", "ERROR_SUFFIX", "FILE_PREFIX"]
