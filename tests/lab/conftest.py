"""The lab fixtures: real hosts (network namespaces with their own sshd and
filesystem view) on this machine. Skipped, with the reason, where a lab cannot
be made (not root, not Linux, no sshd, no namespaces)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from segctl.orchestrator import lab as lablib

HOSTS = 3


def ssh(lab: lablib.Lab, host, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(lablib.ssh_argv(lab, host, command), capture_output=True, text=True,
                          timeout=timeout)


def run_in(host: lablib.Host, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(lablib.inside(host, argv), capture_output=True, text=True,
                          timeout=timeout)


def _skip_unless_possible() -> None:
    reason = lablib.why_not()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def lab(request):
    """A lab of HOSTS hosts (or the module's LAB_HOSTS) for one test module, taken
    down after it whatever the tests did (a lab that cannot come up fails the
    tests, with up's one line)."""
    _skip_unless_possible()
    made = lablib.up(getattr(request.module, "LAB_HOSTS", HOSTS))
    try:
        yield made
    finally:
        lablib.down(made.root)


@pytest.fixture
def lab_machine():
    """No lab up, but one may be made (at the default root) by the test; whatever
    it made is taken down afterwards."""
    _skip_unless_possible()
    yield lablib.LAB_ROOT
    lablib.down(lablib.LAB_ROOT)


def commands(pids: list[int]) -> list[str]:
    """The command lines of `pids` (shortened), to say what a host still runs."""
    out = []
    for p in pids:
        try:
            out.append(Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:120])
        except OSError:
            pass
    return out
