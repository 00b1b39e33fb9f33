"""Segment boundaries kept on disk instead of in accelerator memory.

The segmented step keeps one evaluated hidden state [1, L, D] per segment from
the forward until the backward reaches that segment again. At long context they
dominate the step's memory: 128K tokens x 4096 x 2 bytes is 1 GB each, 32 GB for
32 segments, all of it idle until the backward wants it, last first. `Boundaries`
is that stack. In memory mode it is a list; in disk mode each array leaves memory
as soon as it is appended and comes back one at a time when popped, so only the
boundary the backward is working on takes memory.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile

import mlx.core as mx
import numpy as np

PREFIX = "segctl-boundaries-"

# bfloat16 has no numpy dtype, so bytes travel as a same-size unsigned integer.
_UNSIGNED = {1: (mx.uint8, np.uint8), 2: (mx.uint16, np.uint16),
             4: (mx.uint32, np.uint32), 8: (mx.uint64, np.uint64)}


class OffloadError(OSError):
    """The boundaries could not be written to disk (out of space)."""


def check_folder(folder: str | os.PathLike) -> str | None:
    """None if scratch files can be made in `folder` (made if missing, as
    Boundaries would), else a one-line reason."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=PREFIX, dir=folder)
        os.close(fd)
        os.unlink(path)
    except OSError as e:
        return f"{os.fspath(folder)}: cannot create scratch files there ({e.strerror or e})"
    return None


class Boundaries:
    """A stack of evaluated [1, L, D] arrays: in memory (folder=None) or on disk."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = None if folder is None else os.fspath(folder)
        self._arrays: list[mx.array] = []  # memory mode
        self._entries: list[tuple[int, tuple[int, ...], mx.Dtype]] = []  # disk mode: offset, shape, dtype
        self._end = 0  # file size: where the next entry goes
        self._file = None
        self._path = None  # only set where the file could not be unlinked while open
        self._closed = False
        if self.folder is None:
            return
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=PREFIX, dir=self.folder)
        self._file = os.fdopen(fd, "r+b", buffering=0)
        # Unlink now and keep only the fd: the name is gone at once, and the kernel
        # frees the blocks when the last fd closes, including when the process dies
        # by SIGKILL or a crash, so no scratch file of GBs is ever left behind.
        # Windows refuses to delete an open file; there it is deleted at close.
        try:
            os.unlink(path)
        except OSError:
            self._path = path

    @property
    def bytes_on_disk(self) -> int:
        return self._end if self._file is not None else 0

    def __len__(self) -> int:
        return len(self._arrays) if self.folder is None else len(self._entries)

    def append(self, h: mx.array) -> None:
        """Keep `h` (already evaluated). In disk mode its bytes go to the file and
        this object holds no reference to it; the caller should drop its own."""
        self._check_open()
        if self.folder is None:
            self._arrays.append(h)
            return
        mx_u, _ = _UNSIGNED[h.dtype.size]
        # A numpy view of MLX's buffer (a copy only if h is not row-contiguous):
        # the bytes go to the file in one write call per chunk the OS accepts.
        data = np.ascontiguousarray(np.array(h.view(mx_u), copy=False))
        view = memoryview(data).cast("B")
        offset, n = self._end, view.nbytes
        fd = self._file.fileno()
        try:
            # write() rather than writing into an mmap: a full disk is then an
            # ENOSPC we can report, not a SIGBUS. Scratch data: never fsync'd.
            os.lseek(fd, offset, os.SEEK_SET)
            done = 0
            while done < n:  # a single write may take less (Linux caps it near 2 GB)
                done += os.write(fd, view[done:])
        except OSError as e:
            try:  # give back what part of it was written
                os.ftruncate(fd, offset)
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                err = OffloadError(
                    f"{self.folder}: no space for {n} bytes of boundaries "
                    f"({offset} already there); free space there or set memory.offload: none")
                err.errno = e.errno
                raise err from e
            raise
        finally:
            del view, data
        self._end = offset + n
        self._entries.append((offset, tuple(h.shape), h.dtype))

    def pop(self) -> mx.array:
        """The last appended array, evaluated; in disk mode the file shrinks by it."""
        self._check_open()
        if not len(self):
            raise IndexError("pop from empty Boundaries")
        if self.folder is None:
            return self._arrays.pop()
        h = self._read(self._entries[-1])
        offset = self._entries.pop()[0]
        # Disk use falls as the backward walks back through the segments.
        os.ftruncate(self._file.fileno(), offset)
        self._end = offset
        return h

    def __getitem__(self, i) -> mx.array:
        """Entry i (negative counts from the top), left in place."""
        self._check_open()
        if self.folder is None:
            return self._arrays[i]
        return self._read(self._entries[i])

    def _read(self, entry) -> mx.array:
        offset, shape, dtype = entry
        mx_u, np_u = _UNSIGNED[dtype.size]
        count = int(np.prod(shape))
        n = count * dtype.size
        if n == 0:
            return mx.zeros(shape, dtype)
        # mmap offsets must be page-aligned: map from the page holding the entry.
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(self._file.fileno(), offset + n - start, access=mmap.ACCESS_READ, offset=start)
        u = None
        try:
            u = np.frombuffer(m, dtype=np_u, count=count, offset=offset - start)
            h = mx.array(u)  # a copy into MLX memory
            mx.eval(h)
        finally:
            u = None  # the map cannot close while numpy still points into it
            m.close()
        h = h.view(dtype).reshape(shape)
        mx.eval(h)
        return h

    def _check_open(self):
        if self._closed:
            raise ValueError("Boundaries is closed")

    def close(self) -> None:
        """Drop every entry and the scratch file. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._arrays.clear()
        self._entries.clear()
        self._end = 0
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._path = None

    def __enter__(self) -> Boundaries:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
