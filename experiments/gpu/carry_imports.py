"""Which modules a carried vLLM imports that the GPU machine's image lacks, found here (no GPU, no image).

The GPU machine has no internet: a module missing there costs a whole re-carry once the machine has
gone cold. This runs the imports here, in a child Python whose path holds only
- the standard library,
- the carried wheels (``--pins``, installed for this Python with ``pip install --no-deps --target``),
- the image's packages (``--image``: names one a line, or the device notes' KINDS.md), taken from
  this environment where it has them (torch and triton always: they stand in for the carried ones),
- the vLLM wheel (``--vllm-wheel``, unpacked) and the project checkout,
and records every top-level module that was asked for and not found, with the module that asked.
Then it builds the app ``vllm serve`` serves (every router a generate model gets). ``vllm.platforms.cuda``
fails here for want of libcuda; everything else must import.
Imports inside functions run only when called: the report also lists the lazy imports of the
modules that were loaded whose top-level module would be missing there (read from their source).
    python experiments/gpu/carry_imports.py --image image.txt --pins experiments/gpu/vllm_0.32_wheels.txt \\
        --vllm-wheel vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl --work /tmp/sim --out report.json
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata as md
import json
import os
import pathlib
import re
import subprocess
import sys
import zipfile

#: What the engine, both GPU model runners, the CUDA platform and ``vllm serve`` import, and the
#: project's own GPU-side modules.
DEFAULT_MODULES = [
    "vllm", "vllm.entrypoints.llm", "vllm.engine.arg_utils", "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core", "vllm.v1.engine.core_client", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor", "vllm.platforms.cuda", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.sample.sampler", "vllm.v1.sample.sampler", "vllm.v1.sample.rejection_sampler",
    "vllm.compilation.backends", "vllm.compilation.cuda_graph", "vllm.compilation.breakable_cudagraph",
    "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.flex_attention", "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen3", "vllm.model_executor.model_loader",
    "vllm.v1.spec_decode.ngram_proposer", "vllm.v1.spec_decode.extract_hidden_states",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
    "vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve", "vllm.entrypoints.launchers.cli_args",
    "vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.openai.chat_completion.serving", "vllm.entrypoints.openai.completion.serving",
    "uvicorn", "uvloop", "experiments.gpu.models", "experiments.gpu.bench_gpu", "experiments.gpu.preflight_313",
    "experiments.serving.bench_gpu", "experiments.bench.grid", "experiments.bench.engines", "aiohttp", "pytest", "httpx", "psutil",
    "uhead_vllm", "uhead_vllm.capture.extension", "uhead_vllm.capture.extract_connector",
    "uhead_vllm.generation", "uhead_vllm.serving.plugin", "uhead_vllm.serving.launch",
    "uhead_vllm.serving.install", "uhead_vllm.cli", "uhead_vllm._testing", "uhead_vllm.runtime",
    "uhead_vllm.models", "openai", "transformers", "anthropic", "python_multipart", "starlette.formparsers",
]

ALIASES = {  # image distributions whose import name is not their normalised name
    "pyyaml": ["yaml"], "pillow": ["PIL"], "opencv-python-headless": ["cv2"], "scikit-learn": ["sklearn"],
    "scikit-image": ["skimage"], "protobuf": ["google"], "python-dateutil": ["dateutil"],
    "nvidia-ml-py": ["pynvml"], "py-cpuinfo": ["cpuinfo"], "attrs": ["attr", "attrs"], "grpcio": ["grpc"],
    "cuda-bindings": ["cuda"], "cuda-core": ["cuda"], "cuda-pathfinder": ["cuda"], "absl-py": ["absl"],
    "cupy-cuda13x": ["cupy"], "pytorch-lightning": ["pytorch_lightning"], "hf-xet": ["hf_xet"],
    "typing-extensions": ["typing_extensions"], "setuptools": ["setuptools", "pkg_resources", "_distutils_hack"],
    "pyre-extensions": ["pyre_extensions"], "mypy-extensions": ["mypy_extensions"], "jinja2": ["jinja2"],
    "markupsafe": ["markupsafe"], "prometheus-client": ["prometheus_client"], "pyzmq": ["zmq"],
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_tops(dist: md.Distribution) -> set[str]:
    """The top-level names a distribution installs (packages, modules, extension modules)."""
    tops = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first.endswith((".dist-info", ".egg-info", ".data")) or first in ("..", "__pycache__", "bin"):
            continue
        tops.add(first)
    return tops


def image_packages(path: pathlib.Path) -> set[str]:
    """The image's package names: one a line, or the device notes' "Packages: a, b, ..." line."""
    text = path.read_text()
    if "Packages: " in text:
        text = text.split("Packages: ", 1)[1].split("\n", 1)[0].rstrip(".").replace(",", " ")
    return {norm(n) for n in text.split() if n.strip()}


def build(args: argparse.Namespace) -> dict:
    work = pathlib.Path(args.work).resolve()
    carried, image, vdir = work / "carried", work / "image", work / "vllm"
    pins = [ln.split("#")[0].strip() for f in args.pins for ln in pathlib.Path(f).read_text().splitlines()]
    pins = [p for p in pins if p and not p.startswith("vllm==")]  # the vLLM wheel: --vllm-wheel
    carried_names = {norm(p.split("==")[0].split("[")[0]) for p in pins}
    # torch, triton and NCCL travel in the torch group; this environment's torch (CPU) stands in for
    # them. torchvision is a CUDA build for torch 2.13 that cannot load here: left out of the check.
    pins = [p for p in pins if p and not re.match(r"(torch|triton|nvidia-nccl|torchvision)[=<>]", p)]
    stamp = work / "carried.pins"
    if not carried.exists() or not stamp.exists() or stamp.read_text() != "\n".join(pins):
        subprocess.run(["rm", "-rf", str(carried)], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                        "--target", str(carried), *pins], check=True)
        stamp.write_text("\n".join(pins))
    if not vdir.exists():
        with zipfile.ZipFile(args.vllm_wheel) as z:
            z.extractall(vdir)
    wanted = image_packages(pathlib.Path(args.image)) | {"torch", "triton"}
    image.mkdir(parents=True, exist_ok=True)
    linked, absent = [], []
    seen = {norm(d.metadata["Name"]): d for d in md.distributions()}
    for name in sorted(wanted - carried_names):
        dist = seen.get(name)
        if dist is None:
            absent.append(name)
            continue
        root = pathlib.Path(dist.locate_file(""))
        for top in dist_tops(dist) | {pathlib.Path(dist._path).name}:  # type: ignore[attr-defined]
            src, dst = root / top, image / top
            if src.exists() and not dst.exists() and not (carried / top).exists():
                dst.symlink_to(src)
        linked.append(name)
    fake = work / "broken"  # metadata only: version checks see the image's build, importing it fails
    fake.mkdir(parents=True, exist_ok=True)  # on the path even when every such package is carried
    args.broken = [b for b in args.broken if norm(b.split("==")[0]) not in carried_names]
    for name, version in (b.split("==") if "==" in b else (b, "0") for b in args.broken):
        info = fake / f"{name}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return {"linked_from_here": linked, "image_packages_not_here": absent, "carried_pins": pins,
            "paths": [str(vdir), str(carried), str(image), str(fake)]}


CHILD = r"""
import importlib, importlib.abc, importlib.machinery, json, sys
paths, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
broken = {b.split("==")[0] for b in json.loads(sys.argv[3])}
sys.path[:0] = paths
missing, broken_hits = {}, {}
def importer(depth):
    f = sys._getframe(depth)
    while f is not None and (f.f_code.co_filename.startswith("<frozen") or "importlib" in f.f_code.co_filename):
        f = f.f_back
    return f"{f.f_globals.get('__name__', '?')}:{f.f_lineno}" if f is not None else "?"
class Broken(importlib.abc.Loader):  # an image package built for the image's torch: present, fails to load
    def create_module(self, spec):
        broken_hits.setdefault(spec.name, set()).add(importer(3))
        raise RuntimeError(f"{spec.name} is the image's build for its own torch (simulated)")
    def exec_module(self, module):
        pass
class BrokenFinder:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in broken and "." not in name:
            return importlib.machinery.ModuleSpec(name, Broken())
        return None
sys.meta_path.insert(0, BrokenFinder())
class Recorder:  # last on sys.meta_path: sees only what no finder found
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names:
            return None
        missing.setdefault(name, set()).add(importer(2))
        return None
sys.meta_path.append(Recorder())
results = {}
for m in modules:
    try:
        importlib.import_module(m)
        results[m] = "ok"
    except BaseException as e:
        results[m] = f"{type(e).__name__}: {e}"[:400]
def build_app():  # what `vllm serve` builds before it serves: every router a generate model gets
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform
    vllm.platforms._current_platform = CpuPlatform()  # no GPU here; the routers do not depend on it
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m"])
    return len(build_app(args, ("generate",)).routes)
try:
    results["vllm serve app (generate)"] = f"ok: {build_app()} routes"
except BaseException as e:
    results["vllm serve app (generate)"] = f"{type(e).__name__}: {e}"[:400]
files = {n: getattr(mod, "__file__", None) for n, mod in list(sys.modules.items())}
print(json.dumps({"results": results, "missing": {k: sorted(v) for k, v in missing.items()},
                  "broken": {k: sorted(v) for k, v in broken_hits.items()},
                  "loaded": {k: v for k, v in files.items() if v}}))
"""


def lazy_imports(loaded: dict[str, str], available: set[str]) -> dict[str, list[str]]:
    """Imports inside functions of the loaded vllm / uhead_vllm modules whose top-level module is
    not available there: what would fail only when that function runs."""
    out: dict[str, list[str]] = {}
    for name, path in loaded.items():
        if not (name.startswith(("vllm", "uhead_vllm"))) or not path or not path.endswith(".py"):
            continue
        try:
            tree = ast.parse(pathlib.Path(path).read_text())
        except (OSError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    mods = []
                    if isinstance(sub, ast.Import):
                        mods = [a.name for a in sub.names]
                    elif isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
                        mods = [sub.module]
                    for mod in mods:
                        top = mod.partition(".")[0]
                        if top not in available and top not in sys.stdlib_module_names:
                            out.setdefault(top, []).append(f"{name}:{sub.lineno}")
    return {k: sorted(set(v))[:8] for k, v in sorted(out.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", required=True)
    ap.add_argument("--pins", required=True, nargs="+", help="pin files (the vLLM group's, then any extra part's)")
    ap.add_argument("--vllm-wheel", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modules", nargs="*", default=DEFAULT_MODULES)
    ap.add_argument("--broken", nargs="*", default=["torchvision==0.26.0"],
                    help="image packages built for the image's torch: importing one fails (recorded)")
    args = ap.parse_args()
    info = build(args)
    repo = str(pathlib.Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-S", "-E", "-c", CHILD, json.dumps([*info["paths"], repo]),
                           json.dumps(args.modules), json.dumps(args.broken)], capture_output=True, text=True, env=env, cwd="/")
    if proc.returncode != 0 or not proc.stdout.strip():
        sys.exit(f"child failed: {proc.stderr[-4000:]}")
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    available = set()
    for p in info["paths"] + [repo]:
        available |= {q.name.split(".")[0] for q in pathlib.Path(p).iterdir()}
    report = {**info, "imports": child["results"], "broken_imported_by": child["broken"],
              "missing_top_level": {k: v for k, v in sorted(child["missing"].items()) if "." not in k},
              "missing_submodules": {k: v for k, v in sorted(child["missing"].items()) if "." in k},
              "lazy_imports_of_absent_modules": lazy_imports(child["loaded"], available),
              "loaded_top_level": sorted({n.partition(".")[0] for n in child["loaded"]})}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    bad = {m: r for m, r in child["results"].items() if not r.startswith("ok")}
    print(f"imports: {len(child['results']) - len(bad)} ok, {len(bad)} failed")
    for m, r in bad.items():
        print(f"  {m}: {r}")
    for k, v in child["broken"].items():
        print(f"image package built for the image's torch imported: {k} by {', '.join(v[:4])}")
    print("missing top-level modules (asked for, not found):")
    for k, v in report["missing_top_level"].items():
        print(f"  {k}: {', '.join(v[:4])}")


if __name__ == "__main__":
    main()
