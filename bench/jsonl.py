"""Reading a benchmark's saved rows (JSON lines) back, for its table."""

from __future__ import annotations

import json
import sys


def read_rows(path: str, prog: str, why_not) -> list[dict]:
    """The rows of a JSON-lines file; a line that is not a JSON object, or that
    `why_not(row)` gives a reason against, is a one-line error (exit 2)."""
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        _fail(f"{prog}: {path}: {e.strerror}")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            _fail(f"{prog}: {path}, line {n}: not JSON ({e})")
        why = why_not(row) if isinstance(row, dict) else "not a JSON object"
        if why:
            _fail(f"{prog}: {path}, line {n}: {why}")
        rows.append(row)
    return rows


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)
