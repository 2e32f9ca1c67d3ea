"""`bdh-train config --explain`: every config key with its default, allowed values and
description, read from the section dataclasses themselves.

- the description is the docstring under each field in the dataclass source (read with `ast`);
- the default is the dataclass default;
- the allowed values come from the section's own `validate`: the key is set to a value no rule
  accepts and the "must be ..." part of the error is shown, so the text is the rule itself.

`docs/config.md` is `explain_markdown()`; a test keeps it current.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import io
import textwrap
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

import tomli_w

from bdh_train.config.keys import config_keys, nearest_key, search_keys
from bdh_train.config.schema import SECTIONS, RunConfig
from bdh_train.errors import ConfigError
from bdh_train.utils import dataclass_in

_PROBE = "\x00not-a-valid-value"
"""A value no rule accepts: a string where a number, flag or list is due, and no choice's name."""


@dataclass(frozen=True)
class KeyDoc:
    """One config key: its dotted path (``[]`` marks the items of a list of tables)."""

    key: str
    default: str
    allowed: str
    description: str


@cache
def field_descriptions(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in `cls`'s source ('' when none)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def format_value(value: Any) -> str:
    """A value as it is written in TOML; None (an unset optional) as 'unset'."""
    if value is None:
        return "unset"
    if value is dataclasses.MISSING:
        return "(required)"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    return tomli_w.dumps({"v": value}).strip()[len("v = ") :]


def _fallback_allowed(hint: Any) -> str:
    origin = typing.get_origin(hint) or hint
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
    }.get(origin, "")


def _probe_allowed(section: str, path: list[tuple[str, str]], hint: Any) -> str:
    """Set the key at `path` in a default section to `_PROBE`, validate, and return the "must
    be ..." part of the error (the type's plain description when the error says otherwise)."""
    try:
        root = SECTIONS[section]()
        node: Any = root
        for name, kind in path[:-1]:
            child = getattr(node, name)
            cls = dataclass_in(typing.get_type_hints(type(node))[name])[1]  # type: ignore[index]
            if kind == "list":
                child = [cls()]
                setattr(node, name, child)
                child = child[0]
            elif child is None:
                child = cls()
                setattr(node, name, child)
            node = child
        setattr(node, path[-1][0], _PROBE)
        with contextlib.redirect_stderr(io.StringIO()):
            root.validate(section)
    except ConfigError as exc:
        where = section + "".join(
            f".{name}" + ("[0]" if kind == "list" else "") for name, kind in path
        )
        message = str(exc)
        if message.startswith(f"{where} must be "):
            return message[len(where) + len(" must be ") :].rsplit(", got ", 1)[0]
    except Exception:  # noqa: BLE001 - a rule that is not a checks.* call: use the type
        pass
    return _fallback_allowed(hint)


def _walk(cls: type, section: str, path: list[tuple[str, str]], defaults: Any) -> list[KeyDoc]:
    docs = field_descriptions(cls)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = (
            section
            + "".join(f".{name}" + ("[]" if kind == "list" else "") for name, kind in path)
            + f".{f.name}"
        )
        default = getattr(defaults, f.name) if defaults is not None else _default(f)
        nested = dataclass_in(hints[f.name])
        if nested is None:
            allowed = _probe_allowed(section, [*path, (f.name, "one")], hints[f.name])
            out.append(KeyDoc(key, format_value(default), allowed, docs.get(f.name, "")))
            continue
        kind, inner = nested
        what = {"one": "a table", "optional": "a table, or unset", "list": "a list of tables"}
        shown = (
            "[]"
            if kind == "list" and default == []
            else ("unset" if default is None else "(the keys below)")
        )
        out.append(KeyDoc(key, shown, what[kind], docs.get(f.name, "")))
        sub_defaults = default if kind == "one" else None
        out.extend(_walk(inner, section, [*path, (f.name, kind)], sub_defaults))
    return out


@cache
def explain_keys() -> tuple[KeyDoc, ...]:
    """Every key of every section, in section and field order."""
    keys: list[KeyDoc] = []
    for section, cls in SECTIONS.items():
        keys.extend(_walk(cls, section, [], None))
    return tuple(keys)


def select_keys(prefix: str = "") -> list[KeyDoc]:
    """The keys equal to `prefix` or under it (a section or table); all when ''. A word
    without a dot that is no section names the keys it finds (`search_keys`: ``lr`` ->
    ``optimizer.lr``, ``optimizer.min_lr``). Nothing found is a ConfigError with the nearest
    key."""
    if not prefix:
        return list(explain_keys())
    chosen = [
        k
        for k in explain_keys()
        if k.key == prefix or k.key.startswith(prefix + ".") or k.key.startswith(prefix + "[]")
    ]
    if not chosen and "." not in prefix:
        found = set(search_keys(prefix, [k.key for k in explain_keys()]))
        chosen = [k for k in explain_keys() if k.key in found]
    if not chosen:
        table, _, name = prefix.rpartition(".")
        near = nearest_key(table, name) if table in (*SECTIONS, *config_keys()) else None
        near = near if near is None or "." in near else f"{table}.{near}"
        near = near or nearest_key("", prefix)
        hint = f" (did you mean {near!r}?)" if near else ""
        raise ConfigError(
            f"unknown config key {prefix!r}{hint}; `bdh-train config --explain` lists them all"
        )
    return chosen


def _value_at(table: Any, key: str) -> Any:
    """The value of dotted `key` in the nested dict of a config; MISSING inside a list of
    tables (no one value) or an unset table."""
    node = table
    for name in key.split("."):
        if not isinstance(node, dict) or name.endswith("[]") or name not in node:
            return dataclasses.MISSING
        node = node[name]
    return node


def explain_text(prefix: str = "", cfg: RunConfig | None = None) -> str:
    """The plain-text listing: `key = value  (allowed)` then the description, indented. With
    `cfg` (a layered config), the value is `cfg`'s, the dataclass default beside it where
    they differ, under a first line saying what `cfg` is layered on."""
    keys = select_keys(prefix)
    effective = cfg.to_dict() if cfg is not None else None
    lines = []
    if cfg is not None:
        on = cfg.layered_on or "no preset"
        lines.append(f"# values as layered on {on}; where they differ, the dataclass default")
    for k in keys:
        notes = [k.allowed] if k.allowed else []
        value = k.default
        if effective is not None and k.default != "(the keys below)":
            found = _value_at(effective, k.key)
            if found is not dataclasses.MISSING and format_value(found) != k.default:
                value = format_value(found)
                notes.append(f"dataclass default {k.default}")
        shown = f"  ({'; '.join(notes)})" if notes else ""
        lines.append(f"{k.key} = {value}{shown}")
        lines.extend(
            textwrap.wrap(k.description, 92, initial_indent="    ", subsequent_indent="    ")
        )
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def explain_markdown() -> str:
    """docs/config.md: one table per section."""
    out = [
        "# Configuration keys",
        "",
        "Generated by `bdh-train config --explain --markdown` from the config dataclasses "
        "(defaults, the rules of each section's `validate`, and the docstring under each "
        "field); do not edit by hand. The presets (`bdh-train config --preset tiny` prints "
        "one resolved) override some defaults; with no preset and no file, `tiny` is used.",
    ]
    for section, cls in SECTIONS.items():
        out += [
            "",
            f"## [{section}]",
            "",
            " ".join((cls.__doc__ or "").split()),
            "",
            "| key | default | allowed | description |",
            "|---|---|---|---|",
        ]
        for k in explain_keys():
            if k.key.split(".", 1)[0] == section:
                key = k.key.split(".", 1)[1]
                out.append(
                    f"| `{key}` | `{_cell(k.default)}` | {_cell(k.allowed)} | "
                    f"{_cell(k.description)} |"
                )
    return "\n".join(out) + "\n"
