"""engine/offload.py: segment boundaries in memory or in an unlinked scratch file."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from segctl.engine import offload
from segctl.engine.offload import Boundaries, OffloadError, check_folder
from tests.conftest import ROOT, cli_env

UNSIGNED = {2: mx.uint16, 4: mx.uint32}


def hidden(L, D, dtype, seed):
    h = mx.random.normal((1, L, D), key=mx.random.key(seed)).astype(dtype)
    if L >= 4:  # values whose bits an arithmetic compare would hide
        h[0, :4, 0] = mx.array([float("nan"), float("inf"), -0.0, -float("inf")]).astype(dtype)
    mx.eval(h)
    return h


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    u = UNSIGNED[a.dtype.size]
    assert mx.array_equal(a.view(u), b.view(u)).item()
    assert mx.array_equal(a, b, equal_nan=True).item()


def stack_of_entries():
    specs = [(17, 8, mx.float32), (64, 32, mx.bfloat16), (5, 3, mx.float16),
             (128, 16, mx.bfloat16), (1, 1, mx.float32), (33, 7, mx.float16)]
    return [hidden(L, D, dt, seed) for seed, (L, D, dt) in enumerate(specs)]


@pytest.fixture(params=["memory", "disk"])
def folder(request, tmp_path):
    return None if request.param == "memory" else tmp_path / "scratch"


def test_round_trip_is_bit_exact_and_last_first(folder):
    arrays = stack_of_entries()
    with Boundaries(folder) as b:
        for h in arrays:
            b.append(h)
        assert len(b) == len(arrays)
        same_bits(b[-1], arrays[-1])
        same_bits(b[0], arrays[0])
        assert len(b) == len(arrays)  # reading leaves the entries in place
        for h in reversed(arrays):
            got = b.pop()
            same_bits(got, h)
        assert len(b) == 0
        with pytest.raises(IndexError):
            b.pop()


def test_non_contiguous_input_round_trips(folder):
    t = mx.random.normal((1, 12, 20), key=mx.random.key(7)).astype(mx.bfloat16)
    h = t.transpose(0, 2, 1)[:, 3:17]  # [1, 14, 12], not row-contiguous
    mx.eval(h)
    with Boundaries(folder) as b:
        b.append(h)
        same_bits(b.pop(), mx.array(h))


def test_disk_file_is_unlinked_and_shrinks_with_pops(tmp_path):
    folder = tmp_path / "new" / "scratch"  # made on demand
    with Boundaries(folder) as b:
        assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700
        assert os.listdir(folder) == []
        sizes = [b.bytes_on_disk]
        for h in stack_of_entries():
            b.append(h)
            sizes.append(b.bytes_on_disk)
            assert os.listdir(folder) == []
        assert sizes == sorted(sizes) and sizes[0] == 0
        b.settle()   # the last write may still be in flight
        assert os.fstat(b._file.fileno()).st_size == sizes[-1]
        while len(b):
            b.pop()
            sizes.pop()
            b.settle()   # the file is cut on the I/O thread
            assert b.bytes_on_disk == sizes[-1] == os.fstat(b._file.fileno()).st_size
        assert b.bytes_on_disk == 0
    assert Boundaries().bytes_on_disk == 0


def test_close_is_idempotent_and_context_closes_on_error(folder):
    b = Boundaries(folder)
    b.append(hidden(4, 4, mx.float32, 0))
    b.close()
    b.close()
    assert len(b) == 0 and b.bytes_on_disk == 0
    with pytest.raises(ValueError):
        b.append(hidden(4, 4, mx.float32, 0))
    with pytest.raises(RuntimeError, match="boom"):
        with Boundaries(folder) as b:
            b.append(hidden(4, 4, mx.float16, 1))
            raise RuntimeError("boom")
    assert b._closed and b.bytes_on_disk == 0
    if folder is not None:
        assert os.listdir(folder) == []


def test_sigkilled_process_leaves_no_file(tmp_path):
    folder = tmp_path / "scratch"
    script = textwrap.dedent(f"""
        import sys, time
        import mlx.core as mx
        from segctl.engine.offload import Boundaries
        b = Boundaries({str(folder)!r})
        h = mx.ones((1, 256, 256), dtype=mx.bfloat16)
        mx.eval(h)
        b.append(h)
        b.append(h)
        print('ready', b.bytes_on_disk, flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=cli_env(),
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        assert line == ["ready", str(2 * 256 * 256 * 2)]
        assert os.listdir(folder) == []
        if os.path.isdir(f"/proc/{child.pid}/fd"):  # Linux: the file lives only as a deleted fd
            targets = [os.readlink(f"/proc/{child.pid}/fd/{fd}")
                       for fd in os.listdir(f"/proc/{child.pid}/fd")]
            assert any("segctl-boundaries-" in t and t.endswith("(deleted)") for t in targets)
    finally:
        child.kill()  # SIGKILL
        child.wait(timeout=10)
        child.stdout.close()
    assert child.returncode == -9
    assert os.listdir(folder) == []


def test_reads_ahead_and_writes_beside_the_caller(tmp_path):
    """A pop leaves the entry below it being read; an append returns while its
    bytes are still being written. Interleaved with both, every entry comes back
    bit-exact and the file holds exactly what is left."""
    arrays = stack_of_entries()
    with Boundaries(tmp_path / "scratch") as b:
        for h in arrays[:4]:
            b.append(h)
        same_bits(b.pop(), arrays[3])
        assert b._ahead is not None and b._ahead[0] == 2   # entry 2 on its way
        b.append(arrays[4])          # pushed over the read ahead: that read is not used
        same_bits(b[-1], arrays[4])
        same_bits(b.pop(), arrays[4])
        same_bits(b.pop(), arrays[2])
        b.append(arrays[5])
        same_bits(b.pop(), arrays[5])
        same_bits(b.pop(), arrays[1])
        same_bits(b.pop(), arrays[0])
        b.settle()
        assert len(b) == 0 and os.fstat(b._file.fileno()).st_size == b.bytes_on_disk == 0


class HostCopies(offload._DeviceCopies):
    """A discrete GPU's copies made by memmove (on the CPU, MLX's memory is host
    memory, so device addresses are host ones), each recorded with its thread.
    After `refuse_after` copies in, the driver refuses."""

    def __init__(self, refuse_after=None):
        self.off, self.calls, self.refuse_after = None, [], refuse_after

    def _note(self, what, n):
        self.calls.append((what, n, threading.current_thread().name))

    def pinned(self, n):
        self._note("pin", n)
        return np.zeros(n, np.uint8)

    def unpin(self, a):
        self._note("unpin", a.nbytes)

    def copy_out(self, dst, src):
        self._note("out", dst.nbytes)
        ctypes.memmove(dst.ctypes.data, src, dst.nbytes)
        return True

    def copy_in(self, dst, src):
        if sum(c[0] == "in" for c in self.calls) == self.refuse_after:
            self.off = "refused"
            return False
        self._note("in", src.nbytes)
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)
        return True


@pytest.mark.parametrize("piece", [8 << 20, 64])
def test_a_discrete_gpus_boundaries_are_copied_through_one_pinned_buffer(tmp_path, monkeypatch,
                                                                        piece):
    """Each boundary goes out and comes back as copies of at most
    `piece` bytes through one page-locked buffer, on the I/O thread, bit-exact; the
    read-back lands in an array of the boundary's own shape and dtype."""
    monkeypatch.setattr(offload, "_PIECE", piece)
    arrays = stack_of_entries()
    copies = HostCopies()
    with Boundaries(tmp_path / "scratch", copies=copies) as b:
        for h in arrays:
            b.append(h)
        b.settle()
        for h in reversed(arrays):
            same_bits(b.pop(), h)
        b.settle()
    calls = copies.calls
    assert [c[:2] for c in calls if c[0] in ("pin", "unpin")] == [("pin", piece), ("unpin", piece)]
    for way in ("out", "in"):
        sizes = [c[1] for c in calls if c[0] == way]
        assert max(sizes) <= piece and sum(sizes) == sum(h.nbytes for h in arrays)
    assert all(c[2].startswith("boundaries-io") for c in calls if c[0] != "unpin")


def test_a_copy_the_driver_refuses_midway_reads_the_boundary_again(tmp_path, monkeypatch):
    """A refused copy leaves a read-back part filled: that entry is read again the
    way the CPU reads it, and every later one too, bit-exact."""
    monkeypatch.setattr(offload, "_PIECE", 64)   # the last entry (462 bytes) in 8 pieces
    arrays = stack_of_entries()
    copies = HostCopies(refuse_after=3)
    with Boundaries(tmp_path / "scratch", copies=copies) as b:
        for h in arrays:
            b.append(h)
        for h in reversed(arrays):
            same_bits(b.pop(), h)
    assert copies.off == "refused" and [c[0] for c in copies.calls].count("in") == 3


def test_a_driver_that_refuses_turns_the_copies_off_not_the_step(tmp_path):
    """A refused call warns once, later boundaries go through host memory, and
    every entry still comes back bit-exact."""
    class Refusing(offload._DeviceCopies):
        def __init__(self):   # no driver here: the first call into it fails
            self.off = None

        def _bind(self):
            raise OSError("CUDA driver: cuCtxSetCurrent failed (error 201)")

    copies = Refusing()
    arrays = stack_of_entries()
    with pytest.warns(RuntimeWarning, match="through host memory"):
        with Boundaries(tmp_path / "scratch", copies=copies) as b:
            for h in arrays:
                b.append(h)
            for h in reversed(arrays):
                same_bits(b.pop(), h)
    assert "error 201" in copies.off


def test_the_caller_s_time_and_waits_are_counted(folder):
    arrays = stack_of_entries()
    with Boundaries(folder) as b:
        for h in arrays:
            b.append(h)
        for h in reversed(arrays):
            same_bits(b.pop(), h)
    s = b.seconds
    if folder is None:   # nothing handed over, nothing waited for
        assert s == {"write_wait": 0.0, "read_wait": 0.0, "append": 0.0, "pop": 0.0}
    else:
        # each wait is inside an append or a pop: the last append's write may still
        # be going when the first pop comes, and that pop waits for it
        assert s["append"] > 0 and s["pop"] > 0 and s["write_wait"] >= 0 and s["read_wait"] >= 0
        assert s["append"] + s["pop"] >= s["write_wait"] + s["read_wait"]


def test_a_write_still_going_at_the_first_pop_is_waited_for_there(tmp_path, monkeypatch):
    """The pop that follows an append at once waits for that append's write: a
    write wait counted in the pop's time, not the append's (which returned)."""
    write = Boundaries._write

    def slow(self, *args):
        time.sleep(0.3)
        write(self, *args)
    monkeypatch.setattr(Boundaries, "_write", slow)
    [h] = stack_of_entries()[:1]
    with Boundaries(tmp_path / "scratch") as b:
        b.append(h)
        same_bits(b.pop(), h)
    s = b.seconds
    assert s["write_wait"] >= 0.2 and s["append"] < 0.2 <= s["pop"]
    assert s["pop"] >= s["write_wait"] + s["read_wait"]


def test_check_folder(tmp_path):
    assert check_folder(tmp_path / "made") is None
    assert os.listdir(tmp_path / "made") == []
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    reason = check_folder(not_a_dir / "sub")
    assert reason is not None and "\n" not in reason and str(not_a_dir) in reason


def test_full_disk_raises_offload_error(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tiny tmpfs")
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", str(tiny)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {mounted.stderr.strip()}")
    try:
        with Boundaries(tiny) as b:
            small = hidden(16, 16, mx.float32, 0)
            b.append(small)
            before = b.bytes_on_disk
            with pytest.raises(OffloadError) as err:
                b.append(mx.zeros((1, 1024, 1024), dtype=mx.float32))  # 4 MB
                b.flush()   # the write runs beside the caller: its error comes here
            msg = str(err.value)
            assert isinstance(err.value, OSError)
            assert str(tiny) in msg and "memory.offload: none" in msg and "\n" not in msg
            # The failed entry is gone and the stack still works.
            assert len(b) == 1 and b.bytes_on_disk == before
            b.append(small)
            same_bits(b.pop(), small)
            same_bits(b.pop(), small)
        assert os.listdir(tiny) == []
    finally:
        subprocess.run(["umount", str(tiny)], check=True)


def test_bench_offload_runs_every_variant_and_the_step_reports_its_waits(tmp_path, capsys):
    """bench.offload at CPU size: a row per step and variant, each the same step
    (on the CPU there is nothing to copy: the loss and gradients match bit for bit),
    and the disk variants carry the waits the step reported."""
    from bench import offload as bench_offload

    bench_offload.main(["--seq", "256", "--layers", "2", "--dim", "64", "--vocab", "128",
                        "--dtype", "float32", "--no-quantize", "--rounds", "1",
                        "--dir", str(tmp_path / "scratch")])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in rows][1:] == list(bench_offload.VARIANTS)
    assert all(r["max_rel"] == 0.0 and r["loss"] == rows[0]["loss"] for r in rows)
    assert all(r["read_wait_s"] >= 0 and r["write_wait_s"] >= 0 for r in rows)
    # a disk step's thread spends time handing boundaries over, its waits part of it
    # (a write's wait may be the first pop's: test_a_write_still_going_at_the_first_pop...;
    # the row's seconds are rounded to 1e-6 each)
    disk = [r for r in rows if r["variant"] != "memory"]
    assert all(r["append_s"] > 0 and r["pop_s"] > 0 and r["append_s"] + r["pop_s"]
               >= r["read_wait_s"] + r["write_wait_s"] - 4e-6 for r in disk)
    assert all(r["append_s"] == r["pop_s"] == 0 for r in rows if r["variant"] == "memory")
    assert os.listdir(tmp_path / "scratch") == []   # every step's file gone
    # the copier the variants switch is back as it was (none here)
    assert offload._DEVICE_COPIES == [None]
    with pytest.raises(SystemExit) as e:
        bench_offload.main(["--variants", "memory,fast"])
    assert e.value.code == 2 and "unknown fast" in capsys.readouterr().err


class FlippingCopies(HostCopies):
    """Copies that bring one bit back wrong, once."""

    def copy_in(self, dst, src):
        flipped = not any(c[0] == "in" for c in self.calls)
        ok = super().copy_in(dst, src)
        if flipped:
            ctypes.memset(dst, src[0] ^ 1, 1)
        return ok


@pytest.mark.parametrize("copier, equal", [(None, True), (HostCopies, True),
                                           (FlippingCopies, False)])
def test_bench_offloads_check_compares_every_bit_that_comes_back(tmp_path, capsys, monkeypatch,
                                                                 copier, equal):
    """--check round-trips boundaries through the engine's disk path and its
    copier, and a single wrong bit fails the run before any step."""
    from bench import offload as bench_offload

    copies = copier() if copier else None
    monkeypatch.setattr(offload, "_DEVICE_COPIES", [copies])
    argv = ["--seq", "64", "--layers", "1", "--dim", "32", "--vocab", "64", "--dtype",
            "bfloat16", "--no-quantize", "--rounds", "0", "--variants", "memory", "--check", "3"]
    if equal:
        bench_offload.main(argv)
    else:
        with pytest.raises(SystemExit) as e:
            bench_offload.main(argv)
        assert "other bits" in str(e.value.code)
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    check = out[0]
    assert check["bench"] == "offload-check" and check["equal"] is equal
    assert check["boundaries"] == 3 and check["gb"] == round(3 * 64 * 32 * 2 / 1e9, 4)
    assert check["copies_here"] is (copier is not None) and check["copies_off"] is None
    assert len(out) == (2 if equal else 1)   # the first step ran only after a clean check
    if copier:
        assert [c[0] for c in copies.calls].count("in") == 3   # one piece per boundary
