"""Rows written by the device straight into the engine side's shared row file (the default on a GPU).

On the placer path every batch of placed steps goes to pinned memory, then a thread beside the
engine scatters it into the row file: ~130 MB of host copies per SmolLM2 call at 256 sequences,
~15 ms inside ``generate`` on an H100 host (experiments/results/gpu/). Here the worker registers the
row file with CUDA (``cudaHostRegister``: its pages become pinned and the device writes them at
the same address), and each flush is two kernel launches on the copy stream (scatter_kernel.py):
every row's place, ``first + position`` of its slot, claimed so that of rows bound for one place
(a position forwarded again after a rejected draft) the last one wins; then the claimed rows and
their token marks copied into the file by a few programs, so the model keeps the rest of the GPU.
Rows past their slot, or of no slot, are not written. The host does no per-row work; prompt rows
shared by group members are fanned out afterwards by the placer, from the rows already in the file.

Measured on one H100 engine against the placer, calls alternating (experiments/results/gpu/): the
8B shape at 256 sequences 11 ms less of the engine thread's time per call, SmolLM2's placer thread
no longer beside the engine (78 ms of its wall time per call). Without Triton, or where registering
fails, the placer path stays; so it does where ``FILE_WRITES_ENV`` (:mod:`uhead_vllm.envs`) says ``0``. Torch's ops
(``index_copy_`` over every SM, a dozen launches a flush) write where the kernels cannot run: on
CPU, where the tests check them against the placer, and after a kernel failure.
Registering costs ~0.4 s per GiB (measured on an H100), once per row file (the engine side hands
its files out again while nobody holds their rows), and pins the whole file; a file is
unregistered when the engine side lets go of it.
"""

from __future__ import annotations

import warnings

import torch

from .. import envs
from . import scatter_kernel
from .row_files import file_views

_REGISTER_PORTABLE, _REGISTER_MAPPED = 1, 2  # cudaHostRegister flags
_WARMED: set[tuple[int, torch.dtype]] = set()  # (words per row, word) the scatter kernels were compiled for


class FileWriter:
    """Scatters batches of rows into one row file's rows and token marks (device-visible views)."""

    def __init__(self, byte_rows: torch.Tensor, marks: torch.Tensor, word: torch.dtype | None = None,
                 programs: int | None = None):
        self.byte_rows, self.marks = byte_rows, marks  # [rows + 1, bytes per row] uint8, [rows + 1] int32
        self.scratch = byte_rows.shape[0] - 1
        # Rows are copied as the widest words that tile them (``word``: a narrower one, to compare):
        # a GPU thread writes one element, so a warp's store of bytes is 32 bytes, of int64s 256.
        self.word = _widest_word(byte_rows) if word is None else word
        self.rows = byte_rows.view(self.word)
        self._last: torch.Tensor | None = None  # per place, the last row bound for it
        # On a GPU with Triton two kernel launches write a flush, its rows on a few SMs
        # (scatter_kernel.py); ``programs=0``: torch's ops, index_copy_ over the whole GPU (to compare).
        self.programs = scatter_kernel.PROGRAMS if programs is None else programs
        self.kernel = bool(self.programs) and scatter_kernel.available(byte_rows.device)
        self._claims: torch.Tensor | None = None  # the kernels' table: per place, the stamp of its last row
        self._flushes = 0  # writes through the kernels so far (their stamps)

    def write(self, hidden: torch.Tensor, meta: torch.Tensor, first: torch.Tensor, capacity: torch.Tensor) -> None:
        """Rows ``hidden`` [R, C, H] with ``meta`` [2, R] (positions, token ids) into their slots:
        row r goes to ``first[r] + positions[r]`` if that is below ``capacity[r]`` (0 for no
        slot), on the current stream, without waiting for the device. Steps are written from
        vLLM's forward (inference mode) and the last batch from the fetch (outside it): the
        writer's own tensors are made and updated in inference mode either way."""
        with torch.inference_mode():
            self._write(hidden, meta, first, capacity)

    def _write(self, hidden: torch.Tensor, meta: torch.Tensor, first: torch.Tensor, capacity: torch.Tensor) -> None:
        n = hidden.shape[0]
        flat = hidden.reshape(n, -1).view(torch.uint8)
        if flat.shape[1] != self.byte_rows.shape[1]:
            raise ValueError(f"rows of {flat.shape[1]} bytes for a row file of {self.byte_rows.shape[1]}-byte rows")
        rows = self.rows
        if _widest_word(flat).itemsize >= self.word.itemsize:
            flat = flat.view(self.word)
        else:  # rows at an offset the words do not divide: bytes, as the file sees them
            rows = self.byte_rows
        if self.kernel and rows is self.rows and self._kernel_write(flat, meta, first, capacity):
            return
        pos = meta[0]
        index = torch.where((pos >= 0) & (pos < capacity), first + pos, self.scratch)
        index = self._last_wins(index)
        rows.index_copy_(0, index, flat)
        self.marks.index_copy_(0, index, meta[1].to(torch.int32))

    def warm_up(self) -> None:
        """Compile the scatter kernels for this file's row width now (the engine side's
        ``place_into``), not at a generation's first flush; once per width and process. Writes
        nothing: its one row has no slot."""
        key = (self.rows.shape[1], self.rows.dtype)
        if not self.kernel or key in _WARMED:
            return
        device = self.rows.device
        with torch.inference_mode():
            no_slot = torch.tensor([-1], dtype=torch.int64, device=device)
            self._kernel_write(torch.zeros((1, key[0]), dtype=key[1], device=device),
                               torch.tensor([[-1], [0]], dtype=torch.int64, device=device), no_slot, no_slot + 1)
        _WARMED.add(key)

    def _kernel_write(self, flat: torch.Tensor, meta: torch.Tensor, first: torch.Tensor, capacity: torch.Tensor) -> bool:
        """The rows written by the scatter kernels (scatter_kernel.py); False where they failed (e.g.
        Triton cannot compile them here: torch's ops from now on, nothing was written)."""
        if self._claims is None:
            self._claims = torch.zeros(self.scratch + 1, dtype=torch.int64, device=flat.device)
        self._flushes += 1
        try:
            scatter_kernel.scatter_rows(self.rows, flat, self.marks, meta[0], meta[1], first, capacity, self._claims,
                                        self._flushes, self.programs)
            return True
        except Exception as exc:  # noqa: BLE001
            self.kernel = False
            warnings.warn(f"uhead_vllm: the row file is written with torch's ops, the scatter kernels failed: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=4)
            return False

    def _last_wins(self, index: torch.Tensor) -> torch.Tensor:
        """``index`` with every row but the last bound for a place sent to scratch."""
        n = index.shape[0]
        if n < 2:
            return index
        if self._last is None:
            self._last = torch.empty(self.scratch + 1, dtype=torch.int64, device=index.device)
        order = torch.arange(n, device=index.device)
        self._last.scatter_reduce_(0, index, order, "amax", include_self=False)
        return torch.where(self._last[index] == order, index, self.scratch)


def _widest_word(byte_rows: torch.Tensor) -> torch.dtype:
    """The widest of 8, 4, 2 and 1-byte integers whose elements tile every row of ``byte_rows``
    ([N, bytes] uint8, rows contiguous) at aligned addresses."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if byte_rows.shape[1] % size == 0 and byte_rows.data_ptr() % size == 0 and byte_rows.stride(0) % size == 0:
            return dtype
    return torch.uint8


class RegisteredFiles:
    """A worker's row files as the device sees them, by the engine side's key."""

    def __init__(self) -> None:
        self._registered: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # key: (host mapping, device view)
        self.failed = False  # registering failed once: the placer path from then on

    def writer(self, key: str, flat: torch.Tensor, shape: tuple[int, int, int], dtype: str,
               device: torch.device, asked: bool | None = None) -> FileWriter | None:
        """A writer for this call's rows of ``shape`` in the file mapped as ``flat`` (its whole
        mapping), or None where the placer path stays (see the module docstring). ``asked``: the
        engine side's choice (None: this process's ``FILE_WRITES_ENV`` (:mod:`uhead_vllm.envs`) decides)."""
        wanted = envs.file_writes() if asked is None else asked
        if wanted is None:  # the default: the device writes where its kernels run (scatter_kernel.py)
            wanted = scatter_kernel.available(device)
        if not wanted or not key or self.failed:
            return None
        if device.type != "cuda":
            return FileWriter(*file_views(flat, shape, dtype))
        if key not in self._registered:
            view = self._register(flat, device)
            if view is None:
                return None
            self._registered[key] = (flat, view)
        writer = FileWriter(*file_views(self._registered[key][1], shape, dtype))
        writer.warm_up()
        return writer

    def keep_only(self, keys: set[str]) -> None:
        """Forget the files the engine side let go of (their device writes are done: the rows
        were taken), unregistering them before their mapping goes."""
        for key in [k for k in self._registered if k not in keys]:
            flat, _ = self._registered.pop(key)
            torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())

    def _register(self, flat: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """``flat`` pinned and seen as a CUDA tensor at the same address (None: it failed; warned once)."""
        err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), _REGISTER_PORTABLE | _REGISTER_MAPPED)
        problem = None if int(err) == 0 else f"cudaHostRegister returned {err}"
        view = None
        if problem is None:
            try:
                with torch.cuda.device(device):
                    view = torch.as_tensor(_DeviceMemory(flat.data_ptr(), flat.numel()), device=device)
                if view.data_ptr() != flat.data_ptr():
                    problem = "the device sees registered memory at another address"
            except Exception as exc:  # noqa: BLE001  (the placer path then)
                problem = f"{type(exc).__name__}: {exc}"
            if problem is not None:
                torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
        if problem is not None:
            self.failed = True
            warnings.warn(f"uhead_vllm: rows go through the host placer, the device cannot write the row file: {problem}",
                          RuntimeWarning, stacklevel=3)
            return None
        return view


class _DeviceMemory:
    """``nbytes`` at device address ``ptr`` as a uint8 ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}
