"""The model folder on this node: the job's own path when this machine has it,
else a copy fetched from the head in chunks and kept in a cache, so a lab needs
no shared file system and no hand-copying of weights to every Mac.

The cache is keyed by content: the head's manifest carries each file's sha256,
so weights retrained in place (same names, same sizes) are a new cache entry,
and every fetched file is checked against its hash before the folder is used.
The head hashes a file once per (real path, size, mtime, inode), not per request.

A Hugging Face hub-cache snapshot (`models--org--name/snapshots/<rev>/`, whose
files are links into `../../blobs/`) is served as it is: a link of a file listed
in the folder is followed wherever it points, provided it points at a regular
file; a link to a folder or a special file is refused, and a name is never
resolved through a link on its way (only its last part may be one).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from segctl.schemas.atomic import fsync_dir
from segctl.schemas.private import private_dir

CHUNK = 32 << 20   # bytes per call; well under a Mac's 2 GiB object store
HASH_BLOCK = 8 << 20
# A file written this recently may be rewritten within the same mtime tick: its
# hash is not cached (git's "racy" rule), so a rewrite is never missed.
RACY_S = 2.0

_hashes: dict[tuple, str] = {}   # (real path, size, mtime_ns, inode) -> sha256
_hash_lock = threading.Lock()    # one hashing at a time: nodes asking at once wait for one pass


def local_model(path: str, cache: Path, *, manifest: Callable[[str], list[tuple[str, int, str]]],
                chunk: Callable[[str, str, int, int], bytes]) -> str:
    """A folder on this machine holding the model the head calls `path`."""
    if (Path(path) / "config.json").is_file():
        return path
    files = sorted(tuple(f) for f in manifest(path))
    key = hashlib.sha256(repr(files).encode()).hexdigest()[:24]
    dest = cache / key
    if (dest / "config.json").is_file():
        return str(dest)
    with _fetching(dest):   # attempts starting together on this node fetch it once
        return _fetch_folder(path, files, key, cache, dest, chunk)


_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_MU = threading.Lock()


def _fetching(dest: Path) -> threading.Lock:
    with _LOCKS_MU:
        return _LOCKS.setdefault(str(dest), threading.Lock())


def _fetch_folder(path: str, files, key: str, cache: Path, dest: Path, chunk) -> str:
    if (dest / "config.json").is_file():   # fetched while this one waited
        return str(dest)
    private_dir(cache)
    tmp = cache / f".{key}.tmp-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for name, size, digest in files:
            _fetch(path, name, size, digest, tmp / name, chunk)
        try:
            os.replace(tmp, dest)   # whole folder or nothing
        except OSError:
            if not (dest / "config.json").is_file():   # else a concurrent fetch won
                raise
        else:
            fsync_dir(cache)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def _fetch(path: str, name: str, size: int, digest: str, target: Path, chunk) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with open(target, "wb") as f:
        for offset in range(0, size, CHUNK):
            blob = chunk(path, name, offset, min(CHUNK, size - offset))
            h.update(blob)
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    if target.stat().st_size != size or h.hexdigest() != digest:
        raise OSError(f"{path}/{name}: the fetched bytes are not the file the head listed "
                      "(changed on the head while it was fetched?); the next attempt fetches again")


def manifest(folder: str) -> list[tuple[str, int, str]]:
    """The head's side: every file of a model folder, as (relative name, size, sha256)."""
    root = Path(folder)
    out = []
    for dirpath, dirnames, names in os.walk(root):
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):   # os.walk lists, never enters, these
                raise ValueError(f"{Path(dirpath, d)}: a link to a folder; a model folder's "
                                 "links must point at files")
        for n in names:
            rel = str(Path(dirpath, n).relative_to(root))
            real, st = _member(root, rel)
            out.append((rel, st.st_size, _sha256(real, st)))
    return sorted(out)


def read_chunk(folder: str, name: str, offset: int, n: int) -> bytes:
    real, _ = _member(Path(folder), name)
    with open(real, "rb") as f:
        f.seek(offset)
        return f.read(n)


def _member(root: Path, name: str) -> tuple[Path, os.stat_result]:
    """The regular file behind `name` of model folder `root` and its stat. Every
    folder on the way must be a real folder (no link is followed for them); the
    last part may be a link to a regular file anywhere (a hub snapshot's blob)."""
    rel = Path(name)
    if not rel.parts or rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"{name}: not inside {root}")
    here = root
    for part in rel.parts[:-1]:
        here = here / part
        if not stat.S_ISDIR(os.lstat(here).st_mode):
            raise ValueError(f"{name}: not inside {root} ({here} is not a folder of it)")
    path = here / rel.parts[-1]
    try:
        real = path.resolve(strict=True) if path.is_symlink() else path
    except (FileNotFoundError, RuntimeError):   # dangling, or a loop
        raise ValueError(f"{path}: a link to nothing") from None
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file (a folder, device or pipe is not served)")
    return real, st


def _sha256(real: Path, st: os.stat_result) -> str:
    key = (str(real), st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _hashes:
        return _hashes[key]
    with _hash_lock:
        if key in _hashes:     # hashed while we waited
            return _hashes[key]
        h = hashlib.sha256()
        with open(real, "rb") as f:
            while block := f.read(HASH_BLOCK):
                h.update(block)
        if time.time() - st.st_mtime_ns / 1e9 >= RACY_S:
            _hashes[key] = h.hexdigest()
        return h.hexdigest()
