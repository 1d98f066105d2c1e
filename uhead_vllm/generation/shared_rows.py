"""Shared-memory files for captured rows, kept and handed out again while nobody holds their rows.

With vLLM's engine core in its own process, the worker writes each call's rows into a
shared-memory file that the caller maps too (:class:`~uhead_vllm.capture.protocol.SharedDestination`).
Every 4 KiB page of a fresh file is allocated and zeroed on its first write: 1.2 GB of rows at 256
sequences of an 8B-shaped model are ~300k page faults, and on an H100 host they kept the worker's
row placer busy past the end of the generation (measured on an H100; experiments/results/gpu/). A file whose rows
nobody holds any more is handed out again: its pages exist and both processes still map them, so
the rows are written at memory speed.

A file is in use while any tensor made from it lives (results, the prefix row store and the step
cache keep views). The caller's numpy view of the mapping, which every such tensor keeps alive,
carries a finalizer that marks the file idle. At most ``keep_idle`` idle files are kept mapped
(their memory stays with this process); the others are unmapped.
"""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..capture.row_files import file_key

#: Where shared row files live (a RAM-backed file system on Linux).
SHARED_MEMORY_DIR = "/dev/shm"


@dataclass(eq=False)
class RowFile:
    """One shared-memory file, mapped here. ``key`` is unique for the file's life (the worker keeps
    its own mapping under it; inode numbers can come back); ``path`` is its name until the worker
    has mapped it once (then the name is removed: the memory goes with the last mapping)."""

    key: str
    path: str
    file_id: tuple[int, int]  # (device, inode): a worker checks it maps this very file
    nbytes: int
    memory: mmap.mmap
    in_use: bool = True
    named: bool = True


class SharedRowFiles:
    """The shared row files of one engine (every generator on it takes its files from here)."""

    def __init__(self, directory: str = SHARED_MEMORY_DIR, keep_idle: int = 1):
        self.directory = directory
        self.keep_idle = keep_idle
        self._files: list[RowFile] = []
        self.owner = secrets.token_hex(4)  # the key prefix of this process's files (row_files.key_owner)
        # Finalizers may run in any thread, and in this one while it holds the lock (a garbage
        # collection inside take): reentrant.
        self._lock = threading.RLock()
        self.created = 0
        self.reused = 0

    def take(self, nbytes: int) -> tuple[RowFile, torch.Tensor] | None:
        """A file of at least ``nbytes`` and a uint8 tensor of its first ``nbytes``: the smallest
        idle one that is large enough, else a new one; None when the file system lacks room for
        ``nbytes`` (a write past its room would kill the worker with SIGBUS; a reused file's
        pages may not cover the rows of this call, so the check does not count them)."""
        if not self._has_room(nbytes):
            return None
        with self._lock:
            self._unmap_surplus(self.keep_idle)
            fits = [f for f in self._files if not f.in_use and f.nbytes >= nbytes]
            chosen = min(fits, key=lambda f: f.nbytes) if fits else None
            if chosen is not None:
                chosen.in_use = True
                self.reused += 1
        if chosen is None:
            chosen = self._create(nbytes)
        array = np.frombuffer(chosen.memory, dtype=np.uint8, count=nbytes)
        weakref.finalize(array, self._release, chosen)
        with torch.inference_mode(False):  # the row store relies on the buffer's version counter
            return chosen, torch.from_numpy(array)

    def keys(self) -> list[str]:
        """Keys of every file still mapped here: the worker may keep its mappings of these."""
        with self._lock:
            return [f.key for f in self._files]

    def idle_bytes(self) -> int:
        """Bytes of the idle files kept for the next calls (an upper bound: untouched pages cost none)."""
        with self._lock:
            return sum(f.nbytes for f in self._files if not f.in_use)

    def unname(self, row_file: RowFile) -> None:
        """Remove the file's name once the worker had its chance to map it."""
        if row_file.named:
            row_file.named = False
            try:
                os.unlink(row_file.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap every idle file now; files in use go when their last tensor does."""
        with self._lock:
            self._unmap_surplus(keep=0)

    def _has_room(self, nbytes: int) -> bool:
        try:
            room = os.statvfs(self.directory)
        except OSError:
            return False
        return 0 < nbytes <= room.f_bavail * room.f_frsize

    def _create(self, nbytes: int) -> RowFile:
        """A new file sized to the power of two at or above ``nbytes``: a multi-step loop whose
        calls grow a little each step finds its idle file still large enough. Sparse, so the
        size beyond the rows written costs address space only."""
        size = 1 << (nbytes - 1).bit_length()
        fd, path = tempfile.mkstemp(dir=self.directory, prefix="uhead-rows-")
        try:
            os.ftruncate(fd, size)  # sparse: pages appear as the worker writes them
            memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            st = os.fstat(fd)
        except Exception:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        row_file = RowFile(file_key(self.owner), path, (st.st_dev, st.st_ino), size, memory)
        with self._lock:
            self._files.append(row_file)
            self.created += 1
        return row_file

    def _release(self, row_file: RowFile) -> None:
        with self._lock:
            row_file.in_use = False

    def _unmap_surplus(self, keep: int) -> None:
        """Keep the ``keep`` largest idle files; unmap the others (lock held)."""
        idle = sorted((f for f in self._files if not f.in_use), key=lambda f: f.nbytes, reverse=True)
        for f in idle[keep:]:
            try:
                f.memory.close()
            except BufferError:  # a view is still being torn down: next time
                continue
            self.unname(f)
            self._files.remove(f)
