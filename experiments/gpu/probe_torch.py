"""Probe a carried torch + triton on the GPU machine (experiments/gpu/carry_newer_torch.sh).

Runs the checks in a child process with only the carried site folder on PYTHONPATH, so the image's
own torch is shadowed; if torch does not import there, retries with the image's nvidia-* library
folders on LD_LIBRARY_PATH, and if cuDNN refuses its runtime version, retries with torch's cuDNN
version check skipped: the JSON says which environment was needed. Standard library only in the
parent, so it runs under any Python.
    python3 probe_torch.py --site $W/site313 --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import platform
import re
import site
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
LIB_PATTERN = re.compile(
    r"(cudnn|nccl|cublas|cudart|nvrtc|nvJitLink|cusparse|nvshmem|cufft|curand|cusolver|cupti|"
    r"libtorch|libc10|libtriton|libcuda\.so)"
)


def expected_versions() -> dict[str, str]:
    """Versions named by the wheels in this part's manifest (torch-2.13.0-..., triton-3.7.1-...)."""
    out: dict[str, str] = {}
    manifest = HERE / "manifest"
    if manifest.exists():
        for line in manifest.read_text().splitlines():
            if line.startswith("wheels "):
                for whl in line.split()[1:]:
                    name, version = whl.split("-")[:2]
                    out[name] = version
    return out


# ----------------------------------------------------------------------------------------- child
def check(results: dict, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        detail = fn()
        ok = bool(detail.pop("ok", True))
        results[name] = {"ok": ok, **detail}
    except Exception as e:  # noqa: BLE001 - the probe records every failure and goes on
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def child(expect: dict[str, str]) -> dict:
    res: dict = {}
    mods: dict = {}

    def import_torch():
        import torch

        mods["torch"] = torch
        return {
            "ok": torch.__version__.split("+")[0] == expect.get("torch", torch.__version__.split("+")[0])
            and torch.cuda.is_available(),
            "version": torch.__version__,
            "file": torch.__file__,
            "cuda_runtime": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
        }

    check(res, "import_torch", import_torch)
    if not res["import_torch"].get("cuda_available"):
        return res
    torch = mods["torch"]

    def matmul():
        g = torch.Generator().manual_seed(0)
        a = torch.randn(2048, 2048, generator=g).to(torch.bfloat16)
        b = torch.randn(2048, 2048, generator=g).to(torch.bfloat16)
        ref = a.float() @ b.float()
        bf16 = (a.cuda() @ b.cuda()).float().cpu()
        fp32 = (a.float().cuda() @ b.float().cuda()).cpu()
        r16, r32 = rel(bf16, ref), rel(fp32, ref)
        return {"ok": r16 < 1e-2 and r32 < 1e-5, "bf16_rel_err_vs_cpu": r16, "fp32_rel_err_vs_cpu": r32}

    def cudnn_conv():
        torch.backends.cudnn.allow_tf32 = False
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 16, 32, 32, generator=g)
        w = torch.randn(32, 16, 3, 3, generator=g)
        ref = torch.nn.functional.conv2d(x, w, padding=1)
        out = torch.nn.functional.conv2d(x.cuda(), w.cuda(), padding=1).cpu()
        r = rel(out, ref)
        return {"ok": r < 1e-5, "cudnn_version": torch.backends.cudnn.version(), "fp32_rel_err_vs_cpu": r}

    def cuda_graph():
        g = torch.Generator(device="cuda").manual_seed(2)
        x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        f = lambda: torch.relu(x @ w) + 1.0  # noqa: E731 - reads the static input x
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                f()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = f()
        diffs, rels = [], []
        for seed in (3, 4):
            x.copy_(torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16,
                                generator=torch.Generator(device="cuda").manual_seed(seed)))
            graph.replay()
            torch.cuda.synchronize()
            eager = f()
            diffs.append(float((y - eager).abs().max()))
            rels.append(rel(y, eager))
        # the same kernels replayed: expect bit-equal rows; allow bf16 rounding if cuBLAS picks another algorithm
        return {"ok": max(rels) < 1e-2, "replay_max_abs_diff_vs_eager": diffs, "replay_rel_err_vs_eager": rels}

    def nccl():
        import torch.distributed as dist

        store = dist.HashStore()
        dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        t = torch.arange(8, device="cuda", dtype=torch.float32)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        dist.destroy_process_group()
        return {"ok": t.cpu().tolist() == list(map(float, range(8))),
                "nccl_version": ".".join(map(str, torch.cuda.nccl.version()))}

    def triton_kernel():
        import triton
        import triton.language as tl

        @triton.jit
        def add(x_ptr, y_ptr, o_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)

        n = 98_432
        x = torch.rand(n, device="cuda")
        y = torch.rand(n, device="cuda")
        o = torch.empty_like(x)
        add[(triton.cdiv(n, 1024),)](x, y, o, n, BLOCK=1024)
        torch.cuda.synchronize()
        return {"ok": torch.equal(o, x + y) and triton.__version__ == expect.get("triton", triton.__version__),
                "version": triton.__version__, "file": triton.__file__}

    def torch_compile():
        fn = torch.compile(lambda t: torch.sin(t) * 2.0 + t.square(), fullgraph=True)
        t = torch.randn(4096, device="cuda")
        out = fn(t)
        ref = torch.sin(t) * 2.0 + t.square()
        return {"ok": torch.allclose(out, ref, rtol=1e-5, atol=1e-5),
                "max_abs_diff": float((out - ref).abs().max())}

    for name, fn in [("matmul", matmul), ("cudnn_conv", cudnn_conv), ("cuda_graph", cuda_graph),
                     ("nccl", nccl), ("triton_kernel", triton_kernel), ("torch_compile", torch_compile)]:
        check(res, name, fn)
    libs = set()
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if path.startswith("/") and LIB_PATTERN.search(os.path.basename(path)):
            libs.add(path)
    res["loaded_libraries"] = sorted(libs)
    return res


# ---------------------------------------------------------------------------------------- parent
def image_facts() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    facts: dict = {"python": platform.python_version()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        facts["nvidia_smi"] = smi.stdout.strip()
    except Exception as e:  # noqa: BLE001
        facts["nvidia_smi"] = repr(e)
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "list", "--format", "json"], env=env,
                             capture_output=True, text=True, timeout=120).stdout
        keep = re.compile(r"^(nvidia-|cuda-|torch$|triton$|sympy$|networkx$|typing.extensions$|filelock$|"
                          r"jinja2$|fsspec$|setuptools$|numpy$)", re.I)
        facts["image_packages"] = {p["name"]: p["version"] for p in json.loads(out) if keep.match(p["name"])}
    except Exception as e:  # noqa: BLE001
        facts["image_packages"] = repr(e)
    return facts


def image_nvidia_lib_dirs() -> list[str]:
    dirs: set[str] = set()
    for sp in site.getsitepackages():
        for lib in glob.glob(f"{sp}/nvidia/**/lib", recursive=True):
            if glob.glob(f"{lib}/*.so*"):
                dirs.add(lib)
    return sorted(dirs)


def run_child(site_dir: str, extra_env: dict[str, str], expect: dict[str, str]) -> dict:
    tmp = tempfile.mkdtemp(prefix="probe_")
    env = dict(os.environ, PYTHONPATH=site_dir, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", TRITON_CACHE_DIR=f"{tmp}/triton",
               TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor", **extra_env)
    out = f"{tmp}/child.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", out, "--expect", json.dumps(expect)], env=env,
                          capture_output=True, text=True, timeout=420)
    res = json.loads(pathlib.Path(out).read_text()) if os.path.exists(out) else {}
    shown = {k: v for k, v in extra_env.items() if k != "LD_LIBRARY_PATH"}
    if "LD_LIBRARY_PATH" in extra_env:
        shown["LD_LIBRARY_PATH"] = extra_env["LD_LIBRARY_PATH"].split(":")
    return {"extra_env": shown, "returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
            "stderr_tail": proc.stderr[-3000:], "checks": res}


def all_ok(checks: dict) -> bool:
    names = ["import_torch", "matmul", "cudnn_conv", "cuda_graph", "nccl", "triton_kernel", "torch_compile"]
    return all(checks.get(n, {}).get("ok") for n in names)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", help="the folder the carried wheels were installed into")
    ap.add_argument("--out", help="where to write the JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--expect", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        pathlib.Path(args.child).write_text(json.dumps(child(json.loads(args.expect)), indent=1))
        return
    expect = expected_versions()
    report = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "expect": expect,
              "site": args.site, **image_facts(), "attempts": []}
    extra: dict[str, str] = {}
    while True:
        attempt = run_child(args.site, extra, expect)
        report["attempts"].append(attempt)
        checks = attempt["checks"]
        if all_ok(checks):
            break
        if not checks.get("import_torch", {}).get("cuda_available") and "LD_LIBRARY_PATH" not in extra:
            extra["LD_LIBRARY_PATH"] = ":".join(image_nvidia_lib_dirs() + [os.environ.get("LD_LIBRARY_PATH", "")])
            continue
        if ("incompatib" in checks.get("cudnn_conv", {}).get("error", "")
                and "PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK" not in extra):
            extra["PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK"] = "1"
            continue
        break
    report["works"] = all_ok(report["attempts"][-1]["checks"])
    text = json.dumps(report, indent=1)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(text)
    last = report["attempts"][-1]["checks"]
    print(json.dumps({"works": report["works"], "attempts": len(report["attempts"]),
                      "extra_env": list(report["attempts"][-1]["extra_env"]),
                      **{k: {kk: vv for kk, vv in v.items() if kk in ("ok", "error", "version", "cudnn_version",
                                                                       "nccl_version", "device")}
                         for k, v in last.items() if isinstance(v, dict)}}, indent=1))
    print("loaded:", *last.get("loaded_libraries", []), sep="\n  ")


if __name__ == "__main__":
    main()
