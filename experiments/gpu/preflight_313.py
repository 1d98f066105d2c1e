"""Before a GPU run on the carried torch 2.13 + CUDA vLLM 0.32 (device_run_313.sh): does everything
the tests import load there, and which versions ran. A missing module shows here in seconds instead
of as every test failing; the JSON stamps the run's results.
    PYTHONPATH=$W/site313:$PWD python3 -m experiments.gpu.preflight_313 --out $OUT/versions.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import subprocess
import sys
import traceback

#: Imported by the engine (both model runners), ``vllm serve`` and the tests; a failure stops the run.
REQUIRED_MODULES = [
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn",
    "vllm.entrypoints.llm", "vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.openai.api_server", "uvicorn", "uvloop", "openai", "transformers", "torchvision",
    "uhead_vllm.capture.extension", "uhead_vllm.generation", "uhead_vllm.serving.launch",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out: dict = {"commit": os.environ.get("UHEAD_COMMIT"), "python": sys.version.split()[0], "failed": {}}

    def step(name: str, fn) -> None:
        try:
            out[name] = fn()
        except BaseException as e:  # noqa: BLE001 - every failure is recorded, then the run stops
            out["failed"][name] = f"{type(e).__name__}: {e}"[:1500]
            traceback.print_exc()

    def torch_info() -> dict:
        import torch

        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        rel = float(((x @ x).float() - x.float() @ x.float()).norm() / (x.float() @ x.float()).norm())
        return {"torch": torch.__version__, "file": torch.__file__, "cuda": torch.version.cuda,
                "gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
                "gpus": torch.cuda.device_count(), "cudnn": torch.backends.cudnn.version(),
                "nccl": ".".join(map(str, torch.cuda.nccl.version())), "bf16_matmul_rel": rel}

    def versions() -> dict:
        got = {}
        for name in ("triton", "transformers", "tokenizers", "huggingface_hub", "torchvision", "vllm", "openai",
                     "pydantic", "fastapi", "uvicorn", "numpy"):
            mod = importlib.import_module(name)
            got[name] = str(getattr(mod, "__version__", "?"))
        return got

    def torchvision_op() -> str:  # the image's torchvision (built for torch 2.11) fails exactly here
        import torch
        import torchvision

        boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 10, 10]], dtype=torch.float32, device="cuda")
        return str(torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8], device="cuda"), 0.5).tolist())

    def vllm_cuda() -> dict:
        from vllm.platforms import current_platform

        import vllm._C_stable_libtorch  # noqa: F401  (the custom ops a dense model runs)

        if not current_platform.is_cuda():
            raise RuntimeError(f"vLLM's platform is {type(current_platform).__name__}, not CUDA")
        got = {"platform": type(current_platform).__name__}
        try:  # not fatal: without FA3 vLLM picks another attention backend (recorded, then the run goes on)
            from vllm.vllm_flash_attn import flash_attn_interface as fa

            got.update(fa3=fa.FA3_AVAILABLE, fa3_reason=fa.FA3_UNAVAILABLE_REASON, fa2=fa.FA2_AVAILABLE)
        except ImportError as e:
            got["flash_attn_error"] = str(e)[:500]
        return got

    def modules() -> list[str]:
        for name in REQUIRED_MODULES:
            importlib.import_module(name)
        return REQUIRED_MODULES

    def gate() -> dict:
        from uhead_vllm import adapters

        return {"checked": adapters.check_vllm_version(), "supported": adapters.supported_text(),
                "v1_runner": adapters.v1_runner.runner_class().__module__,
                "v2_runner": getattr(adapters.v2_runner.runner_class(), "__module__", None)}

    for name, fn in (("torch", torch_info), ("versions", versions), ("torchvision_nms", torchvision_op),
                     ("vllm_cuda", vllm_cuda), ("modules", modules), ("version_gate", gate)):
        step(name, fn)
    try:
        out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        out["nvidia_smi"] = str(e)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    v = out.get("versions", {})
    print(f"preflight {'FAILED ' + ', '.join(out['failed']) if out['failed'] else 'ok'}: "
          f"torch {out.get('torch', {}).get('torch')} vllm {v.get('vllm')} transformers {v.get('transformers')} "
          f"on {out.get('torch', {}).get('gpu')}")
    sys.exit(1 if out["failed"] else 0)


if __name__ == "__main__":
    main()
