"""The lanes are marks on the tests (`make test-fast` runs `-m "not fleet and not
slow"`): a module that starts Ray or a lab must say `fleet`, or a new one of
them would slip into the fast lane; the lanes stay apart, so `-m slow` never
starts a fleet."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

TESTS = ROOT / "tests"
# What starts Ray on this machine: the embedded fleet of `segctl submit` without
# a cluster, `segctl cluster up`, or Ray itself.
STARTS_RAY = ('ray.init(', 'segctl("cluster", "up"', 'segctl("submit"')


def module_marks(source: str) -> str:
    """The text of the module's `pytestmark = ...`, "" without one."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return ast.unparse(node.value)
    return ""


def test_every_module_that_starts_ray_or_a_lab_is_marked_fleet():
    modules = sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "lab").glob("test_*.py"))
    starts = [m for m in modules if m.parent.name == "lab" or (
        m.name != "test_lanes.py" and any(s in m.read_text() for s in STARTS_RAY))]
    assert len(starts) >= 9, starts   # the fleet tests and the lab's are still found
    for module in starts:
        assert "pytest.mark.fleet" in module_marks(module.read_text()), (
            f"{module.relative_to(ROOT)} starts Ray or a lab: "
            "add `pytestmark = pytest.mark.fleet`")


def test_a_fleet_module_has_no_slow_test():
    for module in sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "lab").glob("test_*.py")):
        source = module.read_text()
        if "pytest.mark.fleet" in module_marks(source):
            assert "pytest.mark.slow" not in source, module.relative_to(ROOT)
