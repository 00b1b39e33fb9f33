"""Errors a user can fix, each one line: `file:line: key: message`."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec file that cannot be used. `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))
