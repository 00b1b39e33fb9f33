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

import ctypes
import errno
import os
import tempfile
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

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
    """A stack of evaluated [1, L, D] arrays: in memory (folder=None) or on disk.

    On disk the file's reads and writes run on one thread of their own, beside the
    compute: an appended boundary is written while the next segment's forward runs,
    and when one is popped the one below it is read ahead while the backward works
    on this one. So at most one boundary is in flight each way (a write holds its
    array until done; a read ahead holds one boundary's bytes, in host memory or,
    on a discrete GPU, already in the device's), and
    the step waits for the disk only where it is slower than a segment's compute.
    A failed write (a full disk) is raised by the next call that waits for it:
    append, pop, flush or read."""

    def __init__(self, folder: str | os.PathLike | None = None,
                 copies: _DeviceCopies | None = None):
        self.folder = None if folder is None else os.fspath(folder)
        # On a discrete GPU, how the I/O thread copies a boundary's bytes out of and
        # into device memory (None: the CPU and Metal, where memory is one)
        self._copies = copies if copies is not None or folder is None else _device_copies()
        self._arrays: list[mx.array] = []  # memory mode
        self._entries: list[tuple[int, tuple[int, ...], mx.Dtype]] = []  # disk mode: offset, shape, dtype
        self._end = 0  # file size: where the next entry goes
        self._file = None
        self._path = None  # only set where the file could not be unlinked while open
        self._closed = False
        self._io = None  # the one thread every file operation runs on, in order
        self._writing: Future | None = None  # the last append's write
        self._ahead: tuple[int, Future] | None = None  # (entry index, its read) read ahead
        # The caller's seconds: waiting for the disk (a write still in flight when
        # the next boundary came, a read not back when the backward wanted it), and
        # in append and pop, waits included (the handing over that its thread pays).
        self.seconds = {"write_wait": 0.0, "read_wait": 0.0, "append": 0.0, "pop": 0.0}
        self._staging: np.ndarray | None = None  # the I/O thread's page-locked buffer
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
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="boundaries-io")

    @property
    def bytes_on_disk(self) -> int:
        """Bytes the file holds once the writes in flight are done."""
        return self._end if self._file is not None else 0

    def __len__(self) -> int:
        return len(self._arrays) if self.folder is None else len(self._entries)

    def append(self, h: mx.array) -> None:
        """Keep `h` (already evaluated). In disk mode its bytes go to the file, and
        this object holds it only until they are written; the caller should drop
        its own reference."""
        self._check_open()
        if self.folder is None:
            self._arrays.append(h)
            return
        t = time.perf_counter()
        self.flush()  # the previous write: one boundary in flight at most
        mx_u, _ = _UNSIGNED[h.dtype.size]
        # A numpy view of MLX's buffer (a copy only if h is not row-contiguous), made
        # here: the I/O thread writes numpy memory and never evaluates MLX arrays.
        view = np.array(h.view(mx_u), copy=False)
        data = np.ascontiguousarray(view)
        offset = self._end
        self._end = offset + data.nbytes
        self._entries.append((offset, tuple(h.shape), h.dtype))
        # copied from the device only where data is MLX's own buffer, not a numpy copy
        staged = self._copies is not None and data is view
        assert self._io is not None
        self._writing = self._io.submit(self._write, offset, data, h, staged)
        self.seconds["append"] += time.perf_counter() - t

    def flush(self) -> None:
        """Wait for the write in flight; a failed one is raised here and its entry
        is gone (the stack stays usable)."""
        self._check_open()
        writing, self._writing = self._writing, None
        if writing is not None:
            try:
                self._wait(writing, "write_wait")
            except OSError:
                offset = self._entries.pop()[0]
                self._end = offset
                raise

    def settle(self) -> None:
        """Wait for every file operation queued: the file's size is then
        `bytes_on_disk`."""
        self.flush()
        if self._io is not None:
            self._io.submit(lambda: None).result()

    def _wait(self, job: Future, key: str):
        t = time.perf_counter()
        try:
            return job.result()
        finally:
            self.seconds[key] += time.perf_counter() - t

    def _write(self, offset: int, data: np.ndarray, h: mx.array, staged: bool) -> None:
        assert self._file is not None
        fd = self._file.fileno()
        try:
            # write() rather than writing into an mmap: a full disk is then an
            # ENOSPC we can report, not a SIGBUS. Scratch data: never fsync'd.
            os.lseek(fd, offset, os.SEEK_SET)
            if not (staged and self._write_staged(fd, offset, data)):
                _write_all(fd, data.data.cast("B"))
        except OSError as e:
            try:  # give back what part of it was written
                os.ftruncate(fd, offset)
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                err = OffloadError(
                    f"{self.folder}: no space for {data.nbytes} bytes of boundaries "
                    f"({offset} already there); free space there or set memory.offload: none")
                err.errno = e.errno
                raise err from e
            raise
        finally:
            del data, h

    def _write_staged(self, fd: int, offset: int, data: np.ndarray) -> bool:
        """Write `data` (device memory) by copying it into the page-locked buffer a
        piece at a time. False, with the file where it was, if the driver refused."""
        stage = self._stage()
        if stage is None:
            return False
        src, n = data.ctypes.data, data.nbytes
        for start in range(0, n, stage.size):
            piece = stage[:min(stage.size, n - start)]
            assert self._copies is not None
            if not self._copies.copy_out(piece, src + start):
                os.lseek(fd, offset, os.SEEK_SET)
                return False
            _write_all(fd, piece.data)
        return True

    def _read_staged(self, offset: int, h: mx.array, dst: int) -> bool:
        """Fill h (device memory at dst) from the file through the page-locked
        buffer, a piece at a time. False if the driver refused."""
        stage = self._stage()
        if stage is None:
            return False
        n = h.nbytes
        for start in range(0, n, stage.size):
            piece = stage[:min(stage.size, n - start)]
            self._read_into(piece.data, offset + start)
            assert self._copies is not None
            if not self._copies.copy_in(dst + start, piece):
                return False
        return True

    def _stage(self) -> np.ndarray | None:
        """The I/O thread's page-locked buffer (None if the driver refused one)."""
        if self._staging is None:
            assert self._copies is not None
            self._staging = self._copies.pinned(_PIECE)
        return self._staging

    def pop(self) -> mx.array:
        """The last appended array, evaluated; in disk mode the file shrinks by it."""
        self._check_open()
        if not len(self):
            raise IndexError("pop from empty Boundaries")
        if self.folder is None:
            return self._arrays.pop()
        t = time.perf_counter()
        self.flush()
        top = len(self._entries) - 1
        ahead, self._ahead = self._ahead, None
        u = self._wait(ahead[1] if ahead and ahead[0] == top else self._read(
            self._entries[top]), "read_wait")
        offset, shape, dtype = self._entries.pop()
        self._end = offset
        if self._entries:  # the next pop's, read while this one is worked on
            self._ahead = (top - 1, self._read(self._entries[top - 1]))
        # Disk use falls as the backward walks back through the segments. On the I/O
        # thread too, after the read ahead: cutting a file waits for the kernel to
        # finish writing back the pages it drops.
        assert self._io is not None
        assert self._file is not None
        self._io.submit(os.ftruncate, self._file.fileno(), offset)
        h = _to_mx(u, shape, dtype)
        self.seconds["pop"] += time.perf_counter() - t
        return h

    def __getitem__(self, i) -> mx.array:
        """Entry i (negative counts from the top), left in place."""
        self._check_open()
        if self.folder is None:
            return self._arrays[i]
        self.flush()
        _, shape, dtype = entry = self._entries[i]
        return _to_mx(self._read(entry).result(), shape, dtype)

    def _read(self, entry) -> Future:
        """The entry's read, queued on the I/O thread. On a discrete GPU its array
        is made here first, by a kernel (so its pages are on the device), and filled
        there by copies."""
        _, shape, dtype = entry
        into = None
        if self._copies is not None and not self._copies.off and 0 not in shape:
            h = mx.zeros(shape, dtype)
            raw = np.array(h.view(_UNSIGNED[dtype.size][0]), copy=False)
            if raw.flags.c_contiguous and raw.nbytes == h.nbytes:   # a buffer of its own
                into = (h, raw.ctypes.data)
        assert self._io is not None
        return self._io.submit(self._load, entry, into)

    def _load(self, entry, into=None) -> np.ndarray | mx.array:
        """An entry's bytes (on the I/O thread): in `into`'s array where there is
        one, else in host memory."""
        if into is not None:
            if self._read_staged(entry[0], *into):
                return into[0]
            del into   # the driver refused: read it into host memory instead
        offset, shape, dtype = entry
        u = np.empty(int(np.prod(shape)), dtype=_UNSIGNED[dtype.size][1])
        self._read_into(u.data.cast("B"), offset)
        return u

    def _read_into(self, view: memoryview, offset: int) -> None:
        assert self._file is not None
        fd = self._file.fileno()
        os.lseek(fd, offset, os.SEEK_SET)
        done = 0
        while done < view.nbytes:
            got = os.readv(fd, [view[done:]])
            if got == 0:
                raise OSError(errno.EIO, f"{self.folder}: boundary file ended early")
            done += got

    def _check_open(self):
        if self._closed:
            raise ValueError("Boundaries is closed")

    def close(self) -> None:
        """Drop every entry and the scratch file. Safe to call more than once;
        waits for the I/O in flight (its errors no longer matter)."""
        if self._closed:
            return
        self._closed = True
        if self._io is not None:
            self._io.shutdown(wait=True, cancel_futures=True)
            self._io = None
        if self._staging is not None:
            assert self._copies is not None
            self._copies.unpin(self._staging)
            self._staging = None
        self._writing = self._ahead = None
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


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < view.nbytes:  # a single write may take less (Linux caps it near 2 GB)
        done += os.write(fd, view[done:])


def _to_mx(u: np.ndarray | mx.array, shape, dtype) -> mx.array:
    """A read-back as the MLX array it was: as it is if it was read into one, else
    bytes in host memory copied into MLX memory."""
    if isinstance(u, mx.array):
        return u
    if u.size == 0:
        return mx.zeros(shape, dtype)
    h = mx.array(u).view(dtype).reshape(shape)
    mx.eval(h)
    return h


# ---------------------------------------------------------------- a discrete GPU's copies

class _DeviceCopies:
    """Copies between MLX's memory on a CUDA device and a page-locked host buffer.

    There MLX keeps arrays in CUDA managed memory, whose pages move on demand, a
    fault at a time. Read from the host, a boundary the device wrote would fault
    every page over, and the next kernel MLX's buffer cache hands that memory to
    would fault them all back while the device waits; a boundary read back through
    host memory would likewise reach the device a fault at a time. The copy engine
    instead copies the bytes where they are, on a stream of its own, beside the
    compute, in pieces through one small page-locked buffer: a boundary's pages
    never leave the device. What that bought, measured: bench/README.md, "Copies
    instead of moves". A call the driver refuses turns the copies off for the
    process, with one warning; that boundary and the rest go through host memory,
    their pages moving by faults, the same bytes either way."""

    def __init__(self, lib: ctypes.CDLL, device: int = 0):
        self._lib = lib
        self._local = threading.local()
        self._check(lib.cuInit(0), "cuInit")
        ctx = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device),
                    "cuDevicePrimaryCtxRetain")
        self._ctx = ctx   # MLX's own: the runtime API computes in the primary context
        lib.cuMemAllocHost_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cuMemFreeHost.argtypes = [ctypes.c_void_p]
        lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                             ctypes.c_void_p]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                             ctypes.c_void_p]
        self.off: str | None = None   # why the copies stopped, once a call failed

    def pinned(self, n: int) -> np.ndarray | None:
        """n bytes of page-locked host memory, which the copy engine reads and
        writes directly (None if the driver refused)."""
        ptr = ctypes.c_void_p()

        def alloc():
            self._bind()
            return self._lib.cuMemAllocHost_v2(ctypes.byref(ptr), n)
        if self._guard("cuMemAllocHost", alloc):
            assert ptr.value is not None   # the driver said it allocated
            return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr.value))
        return None

    def unpin(self, a: np.ndarray) -> None:
        try:
            self._bind()
            self._lib.cuMemFreeHost(ctypes.c_void_p(a.ctypes.data))
        except OSError:
            pass   # no context left: the driver took the memory back with it

    def copy_out(self, dst: np.ndarray, src: int) -> bool:
        """dst.nbytes bytes from device address src into host memory dst."""
        return self._on_stream("cuMemcpyDtoHAsync_v2", dst.ctypes.data, src, dst.nbytes)

    def copy_in(self, dst: int, src: np.ndarray) -> bool:
        """src's bytes (host memory) to device address dst."""
        return self._on_stream("cuMemcpyHtoDAsync_v2", dst, src.ctypes.data, src.nbytes)

    def _on_stream(self, name: str, *args) -> bool:
        """The driver's `name`(*args, stream) on this thread's stream, waited for."""
        def call():
            stream = self._stream()
            self._check(getattr(self._lib, name)(*args, stream), name)
            return self._lib.cuStreamSynchronize(stream)
        return self._guard(name, call)

    def _guard(self, what: str, fn) -> bool:
        """True if fn() returned CUDA_SUCCESS; the first failure turns every later
        call off, with one warning."""
        if self.off:
            return False
        try:
            self._check(fn(), what)
            return True
        except OSError as e:
            self.off = str(e)
            warnings.warn(f"offload: boundaries go through host memory from here on ({e})",
                          RuntimeWarning, stacklevel=3)
            return False

    def _bind(self) -> None:
        """The primary context made current on this thread (once per thread)."""
        if not getattr(self._local, "bound", False):
            self._check(self._lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self._local.bound = True

    def _stream(self) -> ctypes.c_void_p:
        """This thread's stream, made on first use."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            self._bind()
            stream = ctypes.c_void_p()
            self._check(self._lib.cuStreamCreate(ctypes.byref(stream), 1),   # non-blocking
                        "cuStreamCreate")
            self._local.stream = stream
        return stream

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err:
            raise OSError(f"CUDA driver: {what} failed (error {err})")


# Bytes per copy: the page-locked buffer's size. Small enough to pin at once, large
# enough that each call's fixed cost is lost in its transfer.
_PIECE = 8 << 20

_DEVICE_COPIES: list = []   # the process's one _DeviceCopies, or None where no discrete GPU


def _device_copies() -> _DeviceCopies | None:
    """The copier where MLX computes on CUDA; else None."""
    if not _DEVICE_COPIES:
        copies = None
        if mx.default_device() == mx.gpu and mx.cuda.is_available():
            try:
                copies = _DeviceCopies(ctypes.CDLL("libcuda.so.1"))
            except (OSError, AttributeError):   # no driver library, or one too old
                copies = None   # boundaries go through host memory
        _DEVICE_COPIES.append(copies)
    return _DEVICE_COPIES[0]
