"""Errors a user can fix, each one line: `file:line: key: message`."""

from __future__ import annotations

from .names import EXIT_BAD_INPUT


class UserError(Exception):
    """An error said to the user in one line, never with a traceback: the CLI catches
    this one type and exits with `exit_code` (bad input unless a subclass says
    otherwise). Subclasses keep their other bases (ValueError, ...) for callers."""

    exit_code: int = EXIT_BAD_INPUT


class SpecError(UserError, ValueError):
    """A spec file that cannot be used. `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))
