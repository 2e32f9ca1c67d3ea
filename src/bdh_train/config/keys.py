"""The names of the config keys and the one rule for a name that is none: the nearest key in
any section (`training.lr` -> `optimizer.lr`), used by `--set`, config files and
`config --explain` alike; and the search of `config --explain WORD` over the key names.

A key is written as its dotted path from the section (``optimizer.lr``); the items of a list
of tables are marked ``[]`` (``training.gradient_scales[].scale``).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from bdh_train.config.schema import SECTIONS
from bdh_train.errors import ConfigError
from bdh_train.utils import dataclass_in

_CUTOFF = 0.5
"""The least difflib ratio of a near name (that of `utils.suggest`)."""
_ELSEWHERE_CUTOFF = 0.6
"""The least ratio of a near name in another table (a looser match there misleads more)."""


def _walk(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        out.append(key)
        nested = dataclass_in(hints[f.name])
        if nested is not None:
            kind, inner = nested
            out.extend(_walk(inner, key + ("[]" if kind == "list" else "")))
    return out


@cache
def config_keys() -> tuple[str, ...]:
    """Every key of every section (tables too), in section and field order."""
    return tuple(key for section, cls in SECTIONS.items() for key in _walk(cls, section))


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def nearest_key(table: str, name: str) -> str | None:
    """The key meant by `name` in `table` (a section or table path, ``[]`` for list items;
    '' for the top level), which has no such key: a key of that name in another table
    (``training.lr`` -> ``optimizer.lr``), else a near name in the same table, else a near
    name elsewhere. A key of `table` is returned bare (``block_size``), another as its whole
    path; None when nothing is near."""
    keys = config_keys()
    if not table:
        dotted = [k for k in keys if "." in name and k.count(".") == name.count(".")]
        close = difflib.get_close_matches(name, dotted, n=1, cutoff=_ELSEWHERE_CUTOFF)
        if close:
            return close[0]
        close = difflib.get_close_matches(name, SECTIONS, n=1, cutoff=_CUTOFF)
        return close[0] if close else None
    same = [_leaf(k) for k in keys if k.rsplit(".", 1)[0] == table]
    named = [k for k in keys if _leaf(k) == name and not k.startswith(table + ".")]
    if named:
        return min(named, key=lambda k: k.count("."))
    close = difflib.get_close_matches(name, same, n=1, cutoff=_CUTOFF)
    if close:
        return close[0]
    leaves = {_leaf(k): k for k in reversed(keys)}  # a name's first key wins
    close = difflib.get_close_matches(name, leaves, n=1, cutoff=_ELSEWHERE_CUTOFF)
    return leaves[close[0]] if close else None


def keys_named(name: str) -> list[str]:
    """The keys whose last part is `name`, shallowest first, leaving out keys inside lists
    (``[]``), which no --set reaches: where a key given without its section belongs
    (``max_steps`` -> ``training.max_steps``; ``schedule`` -> ``optimizer.schedule``,
    ``parallel.schedule``)."""
    named = [k for k in config_keys() if "[]" not in k and _leaf(k) == name]
    return sorted(named, key=lambda k: k.count("."))


def sectionless_hint(name: str) -> str:
    """' (did you mean 'training.max_steps'?)' for a key given without its section, every
    such key named when several sections hold one of that name; '' when none does."""
    named = keys_named(name)
    return f" (did you mean {' or '.join(repr(k) for k in named)}?)" if named else ""


def key_hint(table: str, name: str) -> str:
    """' (did you mean 'x'?)' with `nearest_key`, or ''."""
    near = nearest_key(table, name)
    return f" (did you mean {near!r}?)" if near else ""


def _known(cls: type, name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(cls)} or name in getattr(cls, "RENAMED", {})


def _check_table(cls: type, table: Mapping[str, Any], where: str, path: str) -> None:
    hints = typing.get_type_hints(cls)
    for name, value in table.items():
        if not _known(cls, name):
            raise ConfigError(f"unknown key {where}.{name}{key_hint(path, name)}")
        name = getattr(cls, "RENAMED", {}).get(name, name)
        nested = dataclass_in(hints[name])
        if nested is None:
            continue
        kind, inner = nested
        if kind == "list" and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    _check_table(inner, item, f"{where}.{name}[{i}]", f"{path}.{name}[]")
        elif isinstance(value, Mapping):
            _check_table(inner, value, f"{where}.{name}", f"{path}.{name}")


def check_keys(data: Mapping[str, Any], label: str = "") -> None:
    """ConfigError for the first key of a config table (sections of tables, as TOML gives
    them) that names no key, with the nearest key in any section; `label` (a file) begins
    the message. Values are not checked here (each section's `validate` does)."""
    try:
        for section, table in data.items():
            if section not in SECTIONS:
                hint = sectionless_hint(section) or key_hint("", section)
                raise ConfigError(f"unknown section {section!r}{hint}")
            if isinstance(table, Mapping):
                _check_table(SECTIONS[section], table, section, section)
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}" if label else str(exc)) from None


def search_keys(word: str, keys: Sequence[str]) -> list[str]:
    """The keys of `keys` a word names for `config --explain WORD`: those with a part that
    contains it (``lr`` -> ``optimizer.lr``, ``optimizer.min_lr``), else those whose last
    part is near it (``warmup`` -> ``optimizer.warmup_steps``)."""
    word = word.lower()
    found = [k for k in keys if any(word in part for part in k.replace("[]", "").split("."))]
    if found:
        return found
    leaves: dict[str, list[str]] = {}
    for k in keys:
        leaves.setdefault(_leaf(k), []).append(k)
    close = difflib.get_close_matches(word, leaves, n=3, cutoff=_ELSEWHERE_CUTOFF)
    return [k for leaf in close for k in leaves[leaf]]
