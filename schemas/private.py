"""Files and folders only their owner can read: segctl keeps people's data,
checkpoints, adapters and the fleet's token in them, on the head and on every
node. The bottom layer (stdlib and schemas.atomic only), so engine, node and
orchestrator can all import it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .atomic import write_atomic


def private_dir(path) -> Path:
    """Folder `path`, made if missing (with any missing parents), readable by its
    owner only (0700) whatever the umask; it must be a folder of this user (a
    name in a shared /tmp may have been taken by someone else first). Parents
    that were already there are left as they are."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass          # made by someone else meanwhile: checked below like any other
        if p != path:
            _own(p, stat.S_ISDIR, "folder")
            os.chmod(p, 0o700)
    _own(path, stat.S_ISDIR, "folder")
    os.chmod(path, 0o700)
    return path


def private_file(path, data: bytes | None = None, *, tmp=None) -> Path:
    """File `path` readable and writable by its owner only (0600) whatever the
    umask: made empty if missing, or replaced atomically by one holding `data`
    if given (schemas.atomic.write_atomic, written aside at `tmp` if given). One
    already there must be a file of this user, not a link (refused before
    anything is written). Its folder must exist."""
    path = Path(path)
    if data is not None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            _own_file(path, st)
        return write_atomic(path, data, mode=0o600, tmp=tmp)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        _own_file(path, os.fstat(fd))
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path


def _own_file(path: Path, st: os.stat_result) -> None:
    if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
        raise PermissionError(f"{path}: not a file of this user (uid {st.st_uid})")


def _own(path: Path, kind, what: str) -> None:
    st = os.stat(path)
    if not kind(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path}: not a {what} of this user (uid {st.st_uid}); "
                              "segctl keeps its files in folders only their owner can read")
