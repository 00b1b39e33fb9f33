"""The one-line user errors share one base, UserError, with the exit code each
maps to: the CLI's group catches that one type. Each keeps its other base, so
`except ValueError` and the like still catch it."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from segctl.engine.data import DataError
from segctl.engine.model import ModelError
from segctl.engine.step import StepError
from segctl.engine.train import OutputError
from segctl.orchestrator import cli
from segctl.orchestrator.gather import Mismatch
from segctl.orchestrator.state_db import StateError, StoreError
from segctl.schemas.errors import SpecError, UserError
from segctl.schemas.names import EXIT_BAD_INPUT, EXIT_INTERNAL


@pytest.mark.parametrize("error, other, code", [
    (SpecError, ValueError, EXIT_BAD_INPUT),
    (DataError, ValueError, EXIT_BAD_INPUT),
    (StepError, ValueError, EXIT_BAD_INPUT),
    (OutputError, ValueError, EXIT_BAD_INPUT),
    (ModelError, Exception, EXIT_BAD_INPUT),
    (StoreError, RuntimeError, EXIT_BAD_INPUT),
    (StateError, StoreError, EXIT_BAD_INPUT),
    (Mismatch, Exception, EXIT_INTERNAL),   # damaged stores, not bad input
])
def test_each_user_error_is_one_type_with_its_exit_code(error, other, code):
    assert issubclass(error, UserError) and issubclass(error, other)
    assert error.exit_code == code


@pytest.mark.parametrize("error, code", [
    (StoreError("state.db: locked by another process"), EXIT_BAD_INPUT),
    (Mismatch("adapters.safetensors: not what its node sent"), EXIT_INTERNAL),
])
def test_the_cli_says_a_user_error_in_one_line_with_its_code(error, code):
    @click.group(cls=cli._Group)
    def group():
        pass

    @group.command()
    def fails():
        raise error

    result = CliRunner().invoke(group, ["fails"])
    assert result.exit_code == code
    assert result.stderr == f"segctl: {error}\n"
