"""The fast lane's list of slow tests names tests that exist: a test renamed or
moved would otherwise drop out of the list silently and slow `make test-fast`."""

from __future__ import annotations

import ast

from tests.conftest import FLEET_MODULES, ROOT, SLOW_MODULES, SLOW_TESTS


def test_every_slow_test_named_in_conftest_exists():
    for entry in sorted(SLOW_TESTS):
        module, name = entry.split("::")
        tree = ast.parse((ROOT / "tests" / module).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"tests/conftest.py SLOW_TESTS: {entry} is not a test any more"
    for module in FLEET_MODULES | SLOW_MODULES:
        assert (ROOT / "tests" / module).is_file(), module
