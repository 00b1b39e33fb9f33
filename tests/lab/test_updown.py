"""`down` leaves nothing of a lab behind, works for a lab made by a process
that is gone, and is a no-op the second time; `up` refuses a second lab and
says in one line why it cannot make one at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from segctl.orchestrator import lab as lablib

from .conftest import ssh

REPO = Path(__file__).resolve().parents[2]


def _up_elsewhere(n: int) -> lablib.Lab:
    """A lab made by another process, gone by the time this one takes it down."""
    made = subprocess.run([sys.executable, "-c", f"from orchestrator import lab; lab.up({n})"],
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
    # something left running in a host, the way a node's `ray start` is
    stray = ssh(lab, "h1", "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!")
    assert stray.returncode == 0, stray.stderr
    doomed = [int(stray.stdout.split()[0])] + [h.sshd_pid for h in lab.hosts]
    assert all(_running(p) for p in doomed)

    lablib.down(lab_machine)

    assert "seglab" not in _netns()
    assert not [n for n in _links() if n == lablib.BRIDGE or n.startswith("seglab")]
    assert not [p for p in doomed if _running(p)]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert "seglab" not in mounts and str(lab_machine) not in mounts
    assert ("/run/netns " in mounts) == ("/run/netns " in mounts_before)
    assert lablib.load(lab_machine) is None
    lablib.down(lab_machine)          # nothing recorded: nothing to do, no error
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
