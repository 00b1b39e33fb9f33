"""YAML -> validated pydantic model, every problem reported with its file:line.

PyYAML's composer keeps the line of every node; we walk the node tree alongside
the plain data so a pydantic error location like ('train', 'iters') maps back to
the line the user wrote. Unknown keys get a "did you mean".
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from .errors import SpecError

M = TypeVar("M", bound=BaseModel)


def load_yaml(path: str | Path) -> tuple[Any, yaml.Node | None]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([f"{path}: file not found"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError([f"{path}: cannot read ({e})"]) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError([f"{path}{line}: invalid YAML: {reason}"]) from None
    return data, node


def validate(model: type[M], path: str | Path, data: Any, node: yaml.Node | None) -> M:
    path = Path(path)
    if not isinstance(data, dict):
        raise SpecError([f"{path}:1: expected a mapping of keys, got "
                         f"{type(data).__name__ if data is not None else 'an empty file'}"])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise SpecError([_problem(path, model, node, err) for err in e.errors()]) from None


def _problem(path: Path, model: type[BaseModel], node, err: dict) -> str:
    loc = [p for p in err["loc"] if not _is_union_tag(p)]
    key = ".".join(str(p) for p in loc) or "(top)"
    line = _line_of(node, loc)
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        choices = _fields_at(model, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), choices, n=1)
        msg = f"unknown key" + (f"; did you mean '{close[0]}'?" if close else
                                f" (known: {', '.join(choices)})")
    elif err["type"] == "missing":
        line = _line_of(node, loc[:-1])
        msg = "required key is missing"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{path}:{line}: {key}: {msg}"


def _is_union_tag(p) -> bool:
    # pydantic adds the chosen union member's type name ('int', 'literal[...]') to loc
    return isinstance(p, str) and (p in ("int", "float", "str", "bool", "none") or "[" in p)


def _line_of(node, loc) -> int:
    line = (node.start_mark.line + 1) if node is not None else 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    line, node = k.start_mark.line + 1, v
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _fields_at(model: type[BaseModel], loc) -> list[str]:
    for part in loc:
        field = model.model_fields.get(str(part)) if isinstance(model, type) else None
        sub = getattr(field, "annotation", None) if field else None
        sub = _model_in(sub)
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


def _model_in(annotation):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found:
            return found
    return None
