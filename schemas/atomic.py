"""One way to replace a file so that a crash leaves either the old bytes or the
new ones, never a mix: write aside in the same folder, fsync the file, rename it
over the target, fsync the folder (so the rename itself survives a power cut).

Every package writes through here (the bottom layer, so engine, node and
orchestrator can all import it); stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Union


def write_atomic(path: Union[str, os.PathLike], data: Union[bytes, str, None] = None, *,
                 write: Optional[Callable[[Path], None]] = None, mode: int = 0o644) -> Path:
    """Replace `path` with `data` (bytes, or text as UTF-8), or with what
    `write(tmp)` writes to the temporary path it is given (for writers that take
    a file name, e.g. mx.save_safetensors; the temporary name keeps the target's
    suffix, since some of them append one). The file gets `mode` whatever the
    umask. Returns `path`."""
    path = Path(path)
    if (data is None) == (write is None):
        raise TypeError("write_atomic takes data or write=, exactly one")
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        if write is not None:
            write(tmp)
        else:
            tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def fsync_dir(folder: Union[str, os.PathLike]) -> None:
    """Make the folder's entries (a rename, a new file) durable."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform without folder handles: the rename is as durable as it gets
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
