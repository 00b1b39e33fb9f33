"""The model folder on this node: the job's own path when this machine has it,
else a copy fetched from the head in chunks and kept in a cache, so a lab needs
no shared file system and no hand-copying of weights to every Mac.

The cache key is the head's path and the files' names and sizes: a model changed
on the head in place (same names, new sizes) is fetched again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable

CHUNK = 32 << 20   # bytes per call; well under a Mac's 2 GiB object store


def local_model(path: str, cache: Path, *, manifest: Callable[[str], list[tuple[str, int]]],
                chunk: Callable[[str, str, int, int], bytes]) -> str:
    """A folder on this machine holding the model the head calls `path`."""
    if (Path(path) / "config.json").is_file():
        return path
    files = manifest(path)
    key = hashlib.sha256(repr((path, sorted(files))).encode()).hexdigest()[:16]
    dest = cache / key
    if (dest / "config.json").is_file():
        return str(dest)
    tmp = cache / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, size in files:
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            for offset in range(0, size, CHUNK):
                f.write(chunk(path, name, offset, min(CHUNK, size - offset)))
            f.flush()
            os.fsync(f.fileno())
        if target.stat().st_size != size:
            raise OSError(f"{path}/{name}: fetched {target.stat().st_size} of {size} bytes")
    try:
        os.replace(tmp, dest)   # whole folder or nothing; a concurrent fetch may win
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def manifest(folder: str) -> list[tuple[str, int]]:
    """The head's side: every file of a model folder, relative name and size."""
    root = Path(folder)
    return [(str(p.relative_to(root)), p.stat().st_size)
            for p in sorted(root.rglob("*")) if p.is_file()]


def read_chunk(folder: str, name: str, offset: int, n: int) -> bytes:
    path = Path(folder) / name
    if Path(folder).resolve() not in path.resolve().parents:
        raise ValueError(f"{name}: not inside {folder}")
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)
