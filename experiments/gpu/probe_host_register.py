"""Probe: can the worker scatter rows from the device straight into the engine side's shared row
file? ``python -m experiments.gpu.probe_host_register --out DIR`` (on the GPU machine).

The file is mapped, registered with CUDA as pinned host memory (``cudaHostRegister``), seen by
torch as a CUDA tensor through ``__cuda_array_interface__`` (the device pointer of registered
memory), and written by ``index_copy_`` on a side stream. Measures the registration's cost per
GiB and a decode-sized scatter (256 rows of SmolLM2's 3 x 576 bf16 columns, and of an 8B model's
3 x 4096) against the copy to pinned memory plus a numpy scatter that the placer does today, and
checks the bytes arrive. Writes ``probe_host_register.json``. Nothing here is used by the package.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from experiments.gpu.writer_words import shared_file

REGISTER_PORTABLE, REGISTER_MAPPED = 1, 2


class _DeviceView:
    """The ``__cuda_array_interface__`` of ``nbytes`` at device address ``ptr`` (uint8)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _timed(f, reps: int = 20) -> float:
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mib", type=int, default=512)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    nbytes = args.mib << 20
    host = shared_file(nbytes)  # every page touched first (a reused row file's pages exist)
    ptr = host.data_ptr()
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    err = cudart.cudaHostRegister(ptr, nbytes, REGISTER_PORTABLE | REGISTER_MAPPED)
    result["register_seconds_per_gib"] = (time.perf_counter() - t0) * (1 << 30) / nbytes
    result["register_error"] = int(err) if not isinstance(err, int) else err
    try:
        view = torch.as_tensor(_DeviceView(ptr, nbytes), device="cuda")
        result["device_view"] = {"device": str(view.device), "same_address": view.data_ptr() == ptr}
    except Exception as exc:  # noqa: BLE001  (the probe reports, never fails)
        result["device_view_error"] = f"{type(exc).__name__}: {exc}"
        (args.out / "probe_host_register.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return
    stream = torch.cuda.Stream()
    for name, width in (("smollm2", 3 * 576 * 2), ("llama8b", 3 * 4096 * 2)):
        rows = nbytes // width
        dest = view[: rows * width].view(rows, width)
        src = torch.randint(0, 255, (256, width), dtype=torch.uint8, device="cuda")
        index = torch.randperm(rows, device="cuda")[:256]

        def scatter() -> None:
            with torch.cuda.stream(stream):
                dest.index_copy_(0, index, src)

        pinned = torch.empty((256, width), dtype=torch.uint8, pin_memory=True)
        host_rows = host[: rows * width].view(rows, width).numpy()
        index_host = index.cpu().numpy()

        def today() -> None:  # copy to pinned memory, then the placer's numpy scatter
            pinned.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            host_rows[index_host] = pinned.numpy()

        scatter()
        stream.synchronize()
        ok = bool(torch.equal(host[: rows * width].view(rows, width)[index.cpu()], src.cpu()))
        result[name] = {"row_bytes": width, "scatter_256_rows_ms": 1e3 * _timed(scatter),
                        "pinned_copy_then_numpy_scatter_ms": 1e3 * _timed(today), "bytes_arrived": ok}
    result["unregister_error"] = int(cudart.cudaHostUnregister(ptr))
    (args.out / "probe_host_register.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
