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


def _problem(path: Path, model: type[BaseModel], node, err: dict, prefix: str = "") -> str:
    loc = [p for p in err["loc"] if not _is_union_tag(p)]
    key = prefix + ".".join(str(p) for p in loc) if loc else prefix.rstrip(".") or "(top)"
    line = _line_of(node, loc)
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        choices = _fields_at(model, loc[:-1])
        msg = "unknown key" + did_you_mean(str(loc[-1]), choices)
    elif err["type"] == "missing":
        line = _line_of(node, loc[:-1])
        msg = "required key is missing"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{path}:{line}: {key}: {msg}"


def _is_union_tag(p) -> bool:
    # pydantic adds the chosen union member's type name ('int', 'literal[...]') to loc
    return isinstance(p, str) and (p in ("int", "float", "str", "bool", "none") or "[" in p)


def problem(path: str | Path, model: type[BaseModel], node, err: dict, prefix: str = "") -> str:
    """One pydantic error of `model` (validated from the YAML under `node`) as
    `file:line: key: message`; `prefix` goes before the key (e.g. "job." for a
    model that sits under that key of the file)."""
    return _problem(Path(path), model, node, err, prefix)


def did_you_mean(word: str, choices: list[str]) -> str:
    """"; did you mean 'x'?" for the closest choice, else the list of choices."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else f" (known: {', '.join(choices)})"


def node_at(node, loc) -> yaml.Node | None:
    """The YAML node at a key path (mapping keys, sequence indexes), or None."""
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == str(part)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            return None
    return node


def line_of(node, loc) -> int:
    """1-based line of the deepest part of `loc` found under `node` (the key's
    line for a mapping entry, the item's line for a sequence entry)."""
    return _line_of(node, loc)


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
    """The keys a YAML mapping at `loc` may have: a field's alias where it has one
    (`lambda`, not the Python name `lambda_`)."""
    for part in loc:
        fields = model.model_fields if isinstance(model, type) else {}
        field = next((f for name, f in fields.items() if str(part) in (name, f.alias)), None)
        sub = _model_in(getattr(field, "annotation", None)) if field else None
        if sub is None:
            return []
        model = sub
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_in(annotation):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found:
            return found
    return None
