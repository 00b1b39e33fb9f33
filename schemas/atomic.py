"""One way to replace a file so that a crash leaves either the old bytes or the
new ones, never a mix: write aside in the same folder, fsync the file, rename it
over the target, fsync the folder (so the rename itself survives a power cut).

Every package writes through here (the bottom layer, so engine, node and
orchestrator can all import it); stdlib only. Renaming a whole folder built
aside into place is the callers' (it is no file write), followed by fsync_dir
on the folder it lands in.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable, Optional, Union

# never through a link someone put at the temporary name (O_EXCL already refuses one)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def write_atomic(path: Union[str, os.PathLike], data: Union[bytes, str, None] = None, *,
                 write: Optional[Callable[[Path], None]] = None, mode: int = 0o644,
                 replace: bool = True, tmp: Union[str, os.PathLike, None] = None) -> Path:
    """Replace `path` with `data` (bytes, or text as UTF-8), or with what
    `write(tmp)` writes to the temporary path it is given (for writers that take
    a file name, e.g. mx.save_safetensors; the temporary name keeps the target's
    suffix, since some of them append one). The file gets `mode` whatever the
    umask, and is owner-only until then (a 0600 secret is never readable by
    others, not even half-written). replace=False never clobbers: the file is
    linked in only where there is none, else FileExistsError (nothing written).
    `tmp`: where to write aside (on the target's filesystem; it must not exist),
    for a writer whose temporaries live in a folder of their own that it clears
    after a crash; by default a hidden name beside the target. Returns `path`."""
    path = Path(path)
    if (data is None) == (write is None):
        raise TypeError("write_atomic takes data or write=, exactly one")
    # unique per call: two threads (or a pid reused after a crash) never share one
    tmp = Path(tmp) if tmp is not None else \
        path.with_name(f".tmp-{os.getpid()}-{secrets.token_hex(4)}-{path.name}")
    try:
        with open(os.open(tmp, _CREATE, 0o600), "wb") as f:
            if data is not None:
                f.write(data.encode() if isinstance(data, str) else data)
        if write is not None:
            write(tmp)
        with open(tmp, "rb") as f:
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)   # FileExistsError where one is there already
            tmp.unlink()
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
