"""The lab fixtures: real hosts (network namespaces with their own sshd and
filesystem view) on this machine. Skipped, with the reason, where a lab cannot
be made (not root, not Linux, no sshd, no namespaces)."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from segctl import lab as lablib

HOSTS = 3


def ssh(lab: lablib.Lab, host, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(lablib.ssh_argv(lab, host, command), capture_output=True, text=True,
                          timeout=timeout)


# Run in a host with a secret on stdin (so no process of the probe carries it on
# its command line) and paths as arguments: prints, as JSON, every place the host
# can read the secret from: each process's /proc cmdline and environ, the token
# file under each process's root (~/.segctl, a head's ~/stores) and working
# folder, each path given.
_PROBE = """
import json, os, sys
secret = sys.stdin.read().strip().encode()
places = list(sys.argv[1:])
for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
    places += [f"/proc/{pid}/{part}" for part in (
        "cmdline", "environ", "cwd/auth_token", "root/root/.segctl/auth_token",
        "root/root/stores/auth_token")]
found = []
for place in places:
    try:
        with open(place, "rb") as f:
            if secret in f.read():
                found.append(place)
    except OSError:
        pass
print(json.dumps(found))
"""


def where_readable(lab: lablib.Lab, host, secret: str, paths=()) -> list[str]:
    """Where `host` can read `secret` (see _PROBE), over ssh."""
    proc = subprocess.run(lablib.ssh_argv(lab, host, " ".join(
        ["python", "-c", shlex.quote(_PROBE), *map(shlex.quote, map(str, paths))])),
        input=secret, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


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
