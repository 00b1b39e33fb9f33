"""schemas.atomic (the one write-aside-and-rename) and schemas.limits.safetensors_header
(the one safetensors header reader)."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest

from segctl.schemas.atomic import fsync_dir, write_atomic
from segctl.schemas.limits import MAX_SAFETENSORS_HEADER_BYTES, safetensors_header


def _names(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_content_is_replaced_and_nothing_is_left_aside(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    assert write_atomic(path, '{"new": 1}') == path
    assert path.read_text() == '{"new": 1}'
    write_atomic(str(path), b"\x00bytes")          # a str path, bytes data
    assert path.read_bytes() == b"\x00bytes"
    assert _names(tmp_path) == {"state.json"}


def test_mode_is_applied_whatever_the_umask(tmp_path, open_umask):
    secret, plain = tmp_path / "token", tmp_path / "plain"
    write_atomic(secret, "s3cret\n", mode=0o600)
    write_atomic(plain, "x")
    assert _mode(secret) == 0o600 and _mode(plain) == 0o644
    write_atomic(secret, "again", mode=0o640)      # a replacement gets its own mode
    assert _mode(secret) == 0o640
    write_atomic(plain, write=lambda t: t.write_text("by name"), mode=0o600)
    assert _mode(plain) == 0o600 and plain.read_text() == "by name"


def test_the_temporary_file_is_owner_only_while_it_is_written(tmp_path, open_umask):
    seen = []
    write_atomic(tmp_path / "token", write=lambda t: seen.append(_mode(t)), mode=0o644)
    assert seen == [0o600]


def test_an_exception_inside_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "adapters.safetensors"
    path.write_bytes(b"old")

    def half(tmp):
        tmp.write_bytes(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_atomic(path, write=half)
    assert path.read_bytes() == b"old"
    assert _names(tmp_path) == {"adapters.safetensors"}
    # nothing is written where there was nothing, either
    with pytest.raises(RuntimeError):
        write_atomic(tmp_path / "new.json", write=half)
    assert _names(tmp_path) == {"adapters.safetensors"}


def test_data_or_write_exactly_one(tmp_path):
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "x")
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "x", b"a", write=lambda t: None)
    assert not list(tmp_path.iterdir())


def test_write_form_keeps_the_suffix_for_mlx_save_safetensors(tmp_path):
    mx = pytest.importorskip("mlx.core")
    path = tmp_path / "adapters.safetensors"
    suffixes = []

    def save(tmp):
        suffixes.append(tmp.suffix)
        mx.save_safetensors(str(tmp), {"w": mx.arange(6, dtype=mx.float32).reshape(2, 3)})

    write_atomic(path, write=save)
    assert suffixes == [".safetensors"]
    assert _names(tmp_path) == {"adapters.safetensors"}   # no stray `<tmp>.safetensors`
    assert mx.load(str(path))["w"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert safetensors_header(path)["w"]["shape"] == [2, 3]


def test_replace_false_never_clobbers(tmp_path):
    path = tmp_path / "auth_token"
    write_atomic(path, "first", mode=0o600, replace=False)
    with pytest.raises(FileExistsError):
        write_atomic(path, "second", mode=0o600, replace=False)
    assert path.read_text() == "first" and _mode(path) == 0o600
    assert _names(tmp_path) == {"auth_token"}


def test_a_link_at_the_target_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "state.json"
    link.symlink_to(victim)
    write_atomic(link, "new")
    assert victim.read_text() == "keep"
    assert not link.is_symlink() and link.read_text() == "new"


def test_threads_writing_one_path_at_once_never_share_a_temp(tmp_path):
    path, errors = tmp_path / "fleet.json", []

    def writer(i):
        try:
            for _ in range(20):
                write_atomic(path, json.dumps({"i": i}))
        except Exception as e:   # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert json.loads(path.read_text())["i"] in range(4)
    assert _names(tmp_path) == {"fleet.json"}


def test_fsync_dir_takes_a_folder_and_shrugs_at_a_missing_one(tmp_path):
    fsync_dir(tmp_path)
    fsync_dir(str(tmp_path))
    fsync_dir(tmp_path / "missing")


# ------------------------------------------------------------------ safetensors_header


def _safetensors(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def test_safetensors_header_from_a_file_and_from_bytes(tmp_path):
    header = {"__metadata__": {"format": "mlx"},
              "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    blob = _safetensors(header, bytes(8))
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    assert safetensors_header(path) == header
    assert safetensors_header(str(path)) == header
    assert safetensors_header(blob, "adapters.safetensors") == header


@pytest.mark.parametrize("blob,why", [
    (b"", "shorter than"),
    (b"\x01\x00", "shorter than"),
    (b"\xff" * 64, "out of range"),                       # longer than the file
    ((MAX_SAFETENSORS_HEADER_BYTES + 1).to_bytes(8, "little"), "out of range"),
    (b"\x02" + b"\x00" * 7 + b"[]", "not a JSON object"),
    (b"\x03" + b"\x00" * 7 + b"{\xff}", "not UTF-8"),
    (_safetensors({"w": {"x": float("nan")}}), "NaN"),
])
def test_safetensors_header_refuses_in_one_line_naming_the_file(tmp_path, blob, why):
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    for source, where in ((path, str(path)), (blob, "adapters.safetensors")):
        with pytest.raises(ValueError) as e:
            safetensors_header(source, None if isinstance(source, os.PathLike) else where)
        msg = str(e.value)
        assert msg.startswith(f"{where}: not a safetensors file (") and why in msg, msg
        assert "\n" not in msg


def test_safetensors_header_refuses_what_is_not_a_regular_file(tmp_path):
    with pytest.raises(ValueError, match="not a safetensors file"):
        safetensors_header(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="not a regular file"):
        safetensors_header(tmp_path)
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):   # never a hang
        safetensors_header(fifo)
