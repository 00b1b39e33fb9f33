"""`down` leaves nothing of a lab behind (no process of any host, even one that
left the host's network), works for a lab made by a process that is gone, and
is a no-op the second time; `up` refuses a second lab, refuses a folder that is
not a lab's without touching it, replaces only what its lab.json records, and
says in one line why it cannot make one at all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from segctl import lab as lablib
from tests.conftest import assert_one_line_error, segctl

from .conftest import ssh

pytestmark = pytest.mark.fleet   # a lab of hosts

REPO = Path(__file__).resolve().parents[2]


def _up_elsewhere(n: int) -> lablib.Lab:
    """A lab made by another process, gone by the time this one takes it down."""
    made = subprocess.run([sys.executable, "-c", f"from segctl import lab; lab.up({n})"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr[-2000:]
    return lablib.load()


def _netns() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


def _running(pid: int) -> bool:
    """In /proc and not a zombie: this machine's init reaps the orphans a lab's
    processes become a second or two after they die."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_down_leaves_nothing_and_twice_is_a_noop(lab_machine):
    mounts_before = Path("/proc/self/mountinfo").read_text()
    lab = _up_elsewhere(2)
    assert lab is not None and [h.name for h in lab.hosts] == ["h1", "h2"]
    assert "seglab-h1" in _netns() and lablib.BRIDGE in _links()
    # something left running in a host, the way a node's `ray start` is, and
    # something that left the host's network for one of its own (still the host's)
    stray = ssh(lab, "h1", "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!; "
                           "env -u LD_PRELOAD setsid unshare --net sleep 601 </dev/null >/dev/null 2>&1 & echo $!")
    assert stray.returncode == 0, stray.stderr
    inner = [int(p) for p in stray.stdout.split()]     # as h1 numbers them
    h1 = lab.host("h1")
    outer = [p for p in lablib.pids(h1) if lablib.inner_pid(p) in inner]
    assert len(outer) == 2, (inner, [(p, lablib.inner_pid(p)) for p in lablib.pids(h1)])
    doomed = outer + [h.sshd_pid for h in lab.hosts]
    assert all(_running(p) for p in doomed)

    lablib.down(lab_machine)

    assert "seglab" not in _netns()
    assert not [n for n in _links() if n == lablib.BRIDGE or n.startswith("seglab")]
    assert not [p for p in doomed if _running(p)]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert "seglab" not in mounts and str(lab_machine) not in mounts
    assert ("/run/netns " in mounts) == ("/run/netns " in mounts_before)
    assert lablib.load(lab_machine) is None
    lablib.down(lab_machine)          # nothing up: nothing to do, no error
    assert lablib.load(lab_machine) is None


def test_up_refuses_while_a_lab_is_up(lab_machine):
    first = lablib.up(1)
    with pytest.raises(lablib.LabError) as e:
        lablib.up(2)
    assert "already up" in str(e.value) and "\n" not in str(e.value)
    assert lablib.load() == first     # the lab that was up is untouched
    assert subprocess.run(lablib.ssh_argv(first, "h1", "true")).returncode == 0


def test_why_not_is_the_one_line_up_raises(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = lablib.why_not()
    assert reason and "root" in reason and "\n" not in reason
    with pytest.raises(lablib.LabError, match="needs root"):
        lablib.up(2)


def test_a_host_that_cannot_boot_rolls_the_lab_back(lab_machine, monkeypatch):
    # h2's boot stops at a mount that cannot be made, after h1 came up
    broken = lablib._BOOT.replace('hostname "$name"', '[ "$name" = h1 ] || '
                                  'mount -n --bind /nonexistent-lab-source /etc/hosts\n'
                                  'hostname "$name"')
    monkeypatch.setattr(lablib, "_BOOT", broken)
    with pytest.raises(lablib.LabError) as e:
        lablib.up(2)
    assert str(e.value).startswith("h2 did not boot: mount: ") and "\n" not in str(e.value)
    assert "seglab" not in _netns()
    assert not [n for n in _links() if n == lablib.BRIDGE or n.startswith("seglab")]
    assert lablib.load() is None


# ------------------------------------------------------------------ the lab's folder

def _snapshot(root: Path) -> dict:
    """Everything about a folder a clobber would change: each entry's type, mode,
    owner, bytes (or link target) and modification time (a folder's changes when
    anything is made or removed in it), the folder's own included."""
    out = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        body = (os.readlink(path) if path.is_symlink() else
                path.read_bytes() if path.is_file() else None)
        out[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, body)
    return out


def test_up_and_down_refuse_a_folder_that_is_not_a_labs_and_touch_nothing(tmp_path):
    """A home-like folder holding what `up` would make (h1/, hosts, a key): refused
    in one line, exit 2, everything byte for byte and mode for mode as it was."""
    home = tmp_path / "somebodys-home"
    (home / "h1" / "notes").mkdir(parents=True)
    (home / "h1" / "notes" / "todo.txt").write_text("buy milk\n")
    (home / "hosts").write_text("10.0.0.1 printer\n")
    (home / "id_ed25519").write_text("not the lab's key\n")
    (home / "h2").symlink_to(home / "h1")
    os.chmod(home / "id_ed25519", 0o640)
    os.chmod(home, 0o755)
    before = _snapshot(home)

    up = segctl("lab", "up", "2", "--root", home)
    assert_one_line_error(up, str(home), "not empty", "lab.json")
    assert up.stdout == ""
    down = segctl("lab", "down", "--root", home)     # no lab.json: nothing to do
    assert down.returncode == 0, down.stderr
    assert _snapshot(home) == before

    # a lab.json that is not a lab's record (someone else's file of that name)
    (home / "lab.json").write_text(json.dumps({"n": 2, "hosts": []}))
    before = _snapshot(home)
    for args in (["up", "2"], ["down"]):
        proc = segctl("lab", *args, "--root", home)
        assert_one_line_error(proc, str(home / "lab.json"), "not a segctl lab")
    assert _snapshot(home) == before
    # nor a file where the folder should be
    with pytest.raises(lablib.NotALab, match="not a folder"):
        lablib.up(1, home / "hosts")
    assert _snapshot(home) == before


def test_up_replaces_only_what_its_lab_json_records(lab_machine):
    root = lab_machine
    first = lablib.up(1)
    assert json.loads((root / "lab.json").read_text())["made"] == sorted(
        {*lablib.FILES, "h1"})
    mark = first.host("h1").home / "left-by-h1"
    mark.write_text("h1's\n")
    lablib.down(root)
    record = json.loads((root / "lab.json").read_text())
    assert record["up"] is False and lablib.load(root) is None
    # the user's things beside the lab, named like a host or not
    theirs = [root / "h7", root / "notes.txt", root / "h3"]
    try:
        (root / "h7").mkdir()
        (root / "h7" / "keep").write_text("mine\n")
        (root / "notes.txt").write_text("mine too\n")
        kept = {p: _snapshot(p) for p in theirs[:2]}

        second = lablib.up(2)
        assert [h.name for h in second.hosts] == ["h1", "h2"]
        assert not mark.exists()                    # h1 was the lab's: replaced
        assert {p: _snapshot(p) for p in kept} == kept
        assert json.loads((root / "lab.json").read_text())["made"] == sorted(
            {*lablib.FILES, "h1", "h2"})
        lablib.down(root)

        # a name the next lab would make that is there but not the lab's: refused
        # before anything is written (the user's h3 and the lab's record stay)
        (root / "h3").mkdir()
        before = _snapshot(root)
        with pytest.raises(lablib.NotALab) as e:
            lablib.up(3)
        assert str(root / "h3") in str(e.value) and "\n" not in str(e.value)
        after = _snapshot(root)
        # the refused `up` took the lab's lock (opening .lock may touch its times)
        assert {k: v for k, v in after.items() if k != ".lock"} == \
            {k: v for k, v in before.items() if k != ".lock"}
    finally:   # the default root stays a lab's folder for the tests after this one
        for p in theirs:
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
