"""How the stores lay an array of bytes on disk: an adapter's tensors or a
checkpoint's files packed back to back into one uint8 zarr array (each part's
[begin, end) in the group's attributes), the per-phase memory peaks as a float32
array, and the safetensors layout an adapter is taken apart and rebuilt by, byte
for byte. Plain functions over folders and bytes: stores.py decides where they go
and when they are final.
"""

from __future__ import annotations

import filecmp
import itertools
import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from segctl.schemas.limits import safetensors_header

CHUNK_BYTES = 16 << 20            # a packed array is stored in chunks of this size
DATA = "data"                     # the one array of a packed adapter or checkpoint
SYNC_THREADS = 8                  # files of one zarr node fsynced at once
# safetensors dtype code -> numpy dtype of its values. BF16 has no numpy dtype: it
# is widened to float32 (exact), as the per-tensor layout stored it in zarr.
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<f4",
          "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
          "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "|b1"}
ITEMSIZE = {"BF16": 2}
# zarr skips a chunk equal to the fill value, and -0.0 == 0.0: write them all, for bit-exactness.
_EVERY_CHUNK = {"write_empty_chunks": True}


# ==================================================================== zarr nodes

def write_packed_group(folder: Path, attrs: dict, parts: list[bytes],
                       names: list[str] | None = None) -> None:
    """A group holding `parts` back to back in one uint8 array, DATA (an adapter's
    tensors, a checkpoint's files). With `names`, the attribute "packed" gives each
    part's [begin, end) in it. One array, not one per tensor or file: each array is a
    metadata file and a chunk file to write and fsync, and zarr round trips to make
    it (an adapter of the demo model is 56 tensors)."""
    blob = b"".join(parts)
    if names is not None:
        ends = list(itertools.accumulate(map(len, parts)))
        attrs = {**attrs, "packed": {n: [e - len(p), e] for n, p, e in zip(names, parts, ends)}}

    zarr, LocalStore = zarr_modules()
    from zarr.core.sync import sync

    async def build():
        g = await zarr.api.asynchronous.open_group(store=LocalStore(folder), mode="w",
                                                   attributes=attrs)
        await g.create_array(DATA, data=np.frombuffer(blob, dtype=np.uint8),
                             chunks=(max(1, min(len(blob), CHUNK_BYTES)),),
                             compressors=None, config=_EVERY_CHUNK)
    sync(build())


def node_attrs(node: Path) -> dict:
    """A zarr node's attributes, from its metadata file alone (zarr v3 keeps them in
    zarr.json): no zarr round trip. FileNotFoundError when there is no node."""
    with open(node / "zarr.json", "rb") as f:
        return json.loads(f.read()).get("attributes", {})


def read_data(node: Path) -> bytes:
    """The bytes of a packed node's DATA array. As written here (one chunk, no
    compression: zarr v3 keeps it at c/0 as it is) the chunk file is read straight,
    without zarr, which takes longer to import than `segctl gather --best 10` to run."""
    meta = json.loads((node / DATA / "zarr.json").read_bytes())
    [size] = meta["shape"]
    if (meta["data_type"] == "uint8" and [c["name"] for c in meta["codecs"]] == ["bytes"]
            and meta["chunk_grid"]["configuration"]["chunk_shape"][0] >= size
            and meta["chunk_key_encoding"] == {"name": "default",
                                               "configuration": {"separator": "/"}}):
        if size == 0:
            return b""
        blob = (node / DATA / "c" / "0").read_bytes()
        if len(blob) == size:
            return blob
    zarr, LocalStore = zarr_modules()
    a = zarr.open_array(store=LocalStore(node / DATA, read_only=True), mode="r")
    return a[...].tobytes()


def zarr_modules():
    """zarr and its LocalStore, imported where first used: the readers of the CLI
    (status, gather) mostly need none of it."""
    import zarr
    import zarr.api.asynchronous
    from zarr.storage import LocalStore
    return zarr, LocalStore


def write_peaks_array(folder: Path, peaks: np.ndarray, attrs: dict) -> None:
    zarr, LocalStore = zarr_modules()
    a = zarr.create_array(store=LocalStore(folder), shape=peaks.shape, dtype="float32",
                          chunks=(max(1, min(peaks.shape[0], 4096)), max(1, peaks.shape[1])),
                          fill_value=float("nan"), config=_EVERY_CHUNK, attributes=attrs)
    if peaks.size:
        a[...] = peaks


# ==================================================================== safetensors

def read_safetensors(blob: bytes) -> tuple[str, bytes, dict[str, tuple[str, tuple, tuple]]]:
    """(header JSON text, data section, name -> (dtype code, shape, (begin, end) in the
    data section)), in the file's data order, each tensor checked against its bytes.
    Both texts are kept as they were: the file is rebuilt byte for byte from them."""
    blob = bytes(blob)
    header = safetensors_header(blob, "adapters.safetensors")
    n = int.from_bytes(blob[:8], "little")
    header_text, data = blob[8:8 + n].decode("utf-8"), blob[8 + n:]
    header.pop("__metadata__", None)
    tensors = {}
    try:
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        for name, h in entries:
            code, shape, (begin, end) = h["dtype"], tuple(h["shape"]), h["data_offsets"]
            if code not in DTYPES:
                raise ValueError(f"{name}: dtype {code} is not supported")
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= len(data)
                    and end - begin == math.prod(shape) * itemsize(code)):
                raise ValueError(f"{name}: truncated or inconsistent data")
            tensors[name] = (code, shape, (begin, end))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"adapters.safetensors: {e}") from None
    return header_text, data, tensors


def tensor_values(raw: bytes, code: str, shape) -> np.ndarray:
    """A tensor's values from its safetensors bytes; BF16, which numpy lacks, widened
    to float32 (exact)."""
    if code == "BF16":
        values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        values = np.frombuffer(raw, dtype=DTYPES[code]).copy()
    return values.reshape(tuple(shape))


def data_section(header_text: str, raw: dict[str, bytes]) -> bytes:
    """A safetensors file's data section from its header and each tensor's bytes."""
    header = json.loads(header_text)
    header.pop("__metadata__", None)
    size = max((h["data_offsets"][1] for h in header.values()), default=0)
    data = bytearray(size)
    for name, h in header.items():
        begin, end = h["data_offsets"]
        data[begin:end] = raw[name]
    return bytes(data)


def tensor_bytes(values: np.ndarray, code: str) -> bytes:
    if code == "BF16":   # widened exactly on the way in, so the low half is zero
        return (np.ascontiguousarray(values, dtype="<f4").view(np.uint32) >> 16).astype("<u2").tobytes()
    return np.ascontiguousarray(values, dtype=DTYPES[code]).tobytes()


def itemsize(code: str) -> int:
    return ITEMSIZE.get(code) or np.dtype(DTYPES[code]).itemsize


# ==================================================================== folders

def same_tree(a: Path, b: Path) -> bool:
    files = lambda root: sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    fa, fb = files(a), files(b)
    return fa == fb and all(filecmp.cmp(a / p, b / p, shallow=False) for p in fa)


def settle_tree(root: Path) -> None:
    """A node built in temp, before it is renamed into place: owner-only modes
    (zarr creates with the umask's), every file on disk (fsynced side by side: an
    adapter is a hundred small files, and the disk commits concurrent syncs together)."""
    files = []
    for dirpath, _, names in os.walk(root):
        os.chmod(dirpath, 0o700)
        for n in names:
            path = os.path.join(dirpath, n)
            os.chmod(path, 0o600)
            files.append(path)
    if len(files) < 4:
        for path in files:
            _fsync(path)
        return
    with ThreadPoolExecutor(max_workers=SYNC_THREADS) as pool:
        list(pool.map(_fsync, files))


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def rmtree(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


