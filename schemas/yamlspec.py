"""YAML -> validated pydantic model, every problem reported with its file:line.

PyYAML's composer keeps the line of every node; we walk the node tree alongside
the plain data so a pydantic error location like ('train', 'iters') maps back to
the line the user wrote. Unknown keys get a "did you mean".
"""

from __future__ import annotations

import difflib
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from .errors import SpecError
from .limits import MAX_PROBLEMS, MAX_SPEC_BYTES, MAX_YAML_DEPTH, one_line, read_bounded
from .mlx_lm_keys import MLX_LM_KEYS

M = TypeVar("M", bound=BaseModel)


# libyaml when PyYAML has it (the pure-Python parser takes seconds on a 1 MB file)
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(path: str | Path) -> tuple[Any, yaml.Node | None]:
    """(data, node tree) of a spec file, within the bounds of schemas/limits.py:
    at most MAX_SPEC_BYTES, MAX_YAML_DEPTH levels deep, no aliases. Raises
    SpecError with one line."""
    path = Path(path)
    try:
        return _load_yaml(path)
    except _Refused as e:
        raise SpecError([one_line(str(e))]) from None


class _Refused(Exception):
    pass


def _load_yaml(path: Path):
    try:
        text = read_bounded(path, MAX_SPEC_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise _Refused(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise _Refused(f"{path}: cannot read (not UTF-8: {e.reason} at byte {e.start})") from None
    except OSError as e:
        raise _Refused(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:  # a device, a pipe, too large
        raise _Refused(f"{path}: {e}") from None
    try:
        _check_events(path, text)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        if isinstance(e, yaml.reader.ReaderError):   # a character YAML does not allow
            line = f":{text.count(chr(10), 0, e.position) + 1}"
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise _Refused(f"{path}{line}: invalid YAML: {reason}") from None
    except (ValueError, OverflowError) as e:  # a scalar its tag cannot hold: 2001-13-45, 1e5000 digits
        raise _Refused(f"{path}: invalid YAML: {str(e).split(';')[0]}") from None
    return data, node


def _check_events(path: Path, text: str) -> None:
    """Refuse aliases and nesting past MAX_YAML_DEPTH from the parser's events,
    before anything is built from them (the composer recurses per level)."""
    depth = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(f"{path}:{event.start_mark.line + 1}: YAML alias *{event.anchor}: "
                           "aliases are not allowed in segctl files (write the value out)")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise _Refused(f"{path}:{event.start_mark.line + 1}: nested deeper than "
                               f"{MAX_YAML_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def validate(model: type[M], path: str | Path, data: Any, node: yaml.Node | None) -> M:
    path = Path(path)
    if not isinstance(data, dict):
        raise SpecError([not_a_mapping(path, data)])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise SpecError(first_problems(path, e.errors(),
                                       lambda err: _problem(path, model, node, err))) from None


def first_problems(path, items: Sequence, line: Callable[[Any], str] = str,
                   more: str = "") -> list[str]:
    """The problem lines of `items` (`line(item)` each, made one line), at most
    MAX_PROBLEMS of them, then `<path>: and N more problems<more>` when there are
    more. Lines past the first MAX_PROBLEMS are never made: a hint costs a fuzzy
    match, and 40,000 bad keys are 40,000 problems."""
    shown = [one_line(line(item)) for item in items[:MAX_PROBLEMS]]
    if (n := len(items) - len(shown)) > 0:
        shown.append(one_line(f"{path}: and {n} more problem{'s' * (n > 1)}{more}"))
    return shown


def not_a_mapping(path, data) -> str:
    """The problem line for a spec file whose top level is not a mapping."""
    return one_line(f"{path}:1: expected a mapping of keys, got "
                    f"{type(data).__name__ if data is not None else 'an empty file'}")


def _problem(path: Path, model: type[BaseModel], node, err: Mapping[str, Any], prefix: str = "") -> str:
    loc = _user_loc(node, err["loc"])
    key = prefix + ".".join(str(p) for p in loc) if loc else prefix.rstrip(".") or "(top)"
    line = problem_line(node, err)
    msg = err["msg"]
    if err["type"] == "extra_forbidden" and loc:
        choices = _fields_at(model, loc[:-1])
        hint = mlx_lm_says(str(loc[-1])) if _is_job(model) else None
        msg = "unknown key" + (hint or did_you_mean(str(loc[-1]), choices))
    elif err["type"] == "missing":
        msg = "required key is missing"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{path}:{line}: {key}: {msg}"


def problem_line(node, err: Mapping[str, Any]) -> int:
    """The line `problem` gives a pydantic error (without making its message): a
    missing key's at its mapping, any other at the key the user wrote."""
    loc = _user_loc(node, err["loc"])
    return _line_of(node, loc[:-1] if err["type"] == "missing" else loc)


def _user_loc(node, loc) -> list:
    """The parts of a pydantic error location the user wrote. Pydantic adds the
    chosen union member's type ('int', "literal['auto']") and '[key]' to it: such a
    part is dropped unless the YAML has a key of that name there ('a[b]: 1')."""
    out = []
    for part in loc:
        child = _child(node, part)
        if child is None and _is_union_tag(part):
            continue
        out.append(part)
        node = child
    return out


def _is_union_tag(p) -> bool:
    return isinstance(p, str) and (p in ("int", "float", "str", "bool", "none") or "[" in p)


def problem(path: str | Path, model: type[BaseModel], node, err: Mapping[str, Any], prefix: str = "") -> str:
    """One pydantic error of `model` (validated from the YAML under `node`) as
    `file:line: key: message`; `prefix` goes before the key (e.g. "job." for a
    model that sits under that key of the file)."""
    return _problem(Path(path), model, node, err, prefix)


def _is_job(model) -> bool:
    # only a job takes mlx-lm's keys' hints (JobSpec says so): in a cluster file
    # they would mislead
    return bool(getattr(model, "mlx_lm_hints", False))


def mlx_lm_says(word: str) -> str | None:
    """": mlx-lm's KEY is segctl's X" for a key of mlx-lm's LoRA config that means
    something in segctl (schemas/mlx_lm_keys.py), else None. Its flags' spelling
    (grad-accumulation-steps) counts too."""
    key = word.replace("-", "_")
    return f": mlx-lm's {word} {MLX_LM_KEYS[key]}" if key in MLX_LM_KEYS else None


def did_you_mean(word: str, choices: list[str]) -> str:
    """"; did you mean 'x'?" for the closest choice, else the list of choices."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else f" (known: {', '.join(choices)})"


def node_at(node, loc) -> yaml.Node | None:
    """The YAML node at a key path (mapping keys, sequence indexes), or None."""
    for part in loc:
        node = _child(node, part)
    return node


def _child(node, part) -> yaml.Node | None:
    """The node under a mapping key or at a sequence index, or None."""
    if isinstance(node, yaml.MappingNode):
        entry = _entries(node).get(str(part))
        return entry[1] if entry else None
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        return node.value[part]
    return None


# A mapping node's key -> (key node, value node), made once per mapping: looking a
# key up by scanning made every problem cost the mapping's length (40,000 unknown
# keys took minutes). Weak keys: the index goes with its node tree.
_INDEX: "weakref.WeakKeyDictionary[yaml.MappingNode, dict]" = weakref.WeakKeyDictionary()


def _entries(node: yaml.MappingNode) -> dict:
    index = _INDEX.get(node)
    if index is None:
        index = {}
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode):
                index.setdefault(k.value, (k, v))   # the first written, as a scan found it
        _INDEX[node] = index
    return index


def line_of(node, loc) -> int:
    """1-based line of the deepest part of `loc` found under `node` (the key's
    line for a mapping entry, the item's line for a sequence entry)."""
    return _line_of(node, loc)


def _line_of(node, loc) -> int:
    line = (node.start_mark.line + 1) if node is not None else 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            entry = _entries(node).get(str(part))
            if entry is None:
                return line
            line, node = entry[0].start_mark.line + 1, entry[1]
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
