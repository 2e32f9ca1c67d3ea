"""Layering a run configuration from presets, files and `--set` overrides, and writing it
back as TOML. The result is validated up front, so a bad value fails before any training
starts.

Layering (`load_config`), lowest priority first:

1. a preset (``tiny`` | ``small`` | ``pathway``, shipped in ``bdh_train/presets``): the one
   given, else the presets the files extend, else ``tiny`` (a CPU demo). So ``bdh-train train``
   with no arguments, and a file that extends no preset, both sit on ``tiny`` rather than on
   the dataclass defaults (a 25 M-parameter model); `RunConfig.layered_on` says which;
2. each file in order; a file may say ``extends = ["base.toml", "preset:tiny"]`` (paths relative
   to that file), and its own values override what it extends;
3. each ``--set section.key=value`` override, the value parsed as a TOML value (a bare word
   that is not valid TOML is taken as a string).

Tables are deep-merged; lists (``optimizer.betas``, ``training.gradient_scales``) are replaced
whole. Unknown keys anywhere are errors that suggest the nearest valid name.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomli_w

from bdh_train.config.keys import check_keys, key_hint, sectionless_hint
from bdh_train.config.schema import SECTIONS, RunConfig
from bdh_train.data.layout import prepared_directory
from bdh_train.data.prepared import corpus_tokenizer
from bdh_train.data.sources import BUILTIN_PREFIX
from bdh_train.data.tokenizer import BYTES, load_tokenizer
from bdh_train.errors import ConfigError
from bdh_train.storage.run_dir import CONFIG_MAX_BYTES, RunDir
from bdh_train.utils import (
    atomic_write,
    dataclass_in,
    read_regular_file,
    renamed_key,
    suggest,
)

PRESETS = ("tiny", "small", "pathway")
DEFAULT_PRESET = "tiny"
"""The preset used when `load_config` gets neither a preset nor a file."""
EXTENDS_KEY = "extends"
PRESET_PREFIX = "preset:"
_A_TOML_FILE = "give the path of a TOML config file"


# --------------------------------------------------------------------------- layering


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top` over `base`: tables merge recursively, anything else (lists too) is replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _preset_resource(name: str) -> Any:
    if name not in PRESETS:
        raise ConfigError(
            f"unknown preset {name!r}; known: {', '.join(PRESETS)}{suggest(name, PRESETS)}"
        )
    return importlib.resources.files("bdh_train") / "presets" / f"{name}.toml"


def _parse_toml(text: str, label: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{label}: invalid TOML: {exc}") from exc


class _Layerer:
    """Resolves `extends` chains into one merged dict, refusing cycles."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.presets: list[str] = []
        """Every preset layered in, in order (a diamond may list one twice)."""
        self.file_keys: set[tuple[str, str]] = set()
        """(section, key) of every value a config file (not a preset) sets."""

    def preset(self, name: str, referrer: str | None = None) -> dict[str, Any]:
        try:
            resource = _preset_resource(name)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (extended by {referrer})" if referrer else str(exc)) from None
        key = f"{PRESET_PREFIX}{name}"
        self.presets.append(name)
        return self._layer(key, resource.read_text(encoding="utf-8"), None)

    def file(self, path: str | Path, referrer: str | None = None) -> dict[str, Any]:
        """The layers of config file `path`: a regular file of at most CONFIG_MAX_BYTES."""
        path = Path(path).expanduser()
        by = f" (extended by {referrer})" if referrer else ""
        try:
            resolved = path.resolve()
            text = read_regular_file(
                resolved, CONFIG_MAX_BYTES, f"config file {path}{by}", ConfigError, _A_TOML_FILE
            ).decode("utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}{by}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}{by}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {path} is not UTF-8 text (byte {exc.start}: "
                f"{exc.object[exc.start : exc.start + 1]!r}); save it as UTF-8"
            ) from None
        return self._layer(str(resolved), text, resolved.parent)

    def _layer(self, key: str, text: str, base_dir: Path | None) -> dict[str, Any]:
        if key in self.stack:
            chain = " -> ".join([*self.stack[self.stack.index(key) :], key])
            raise ConfigError(f"config extends cycle: {chain}")
        self.stack.append(key)
        try:
            data = _parse_toml(text, key)
            if base_dir is not None:
                self.file_keys |= {
                    (section, name)
                    for section, table in data.items()
                    if isinstance(table, Mapping)
                    for name in table
                }
            parents = data.pop(EXTENDS_KEY, [])
            check_keys(data, key)
            if isinstance(parents, str):
                parents = [parents]
            if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
                raise ConfigError(
                    f"{key}: {EXTENDS_KEY} must be a string or a list of strings, got {parents!r}"
                )
            merged: dict[str, Any] = {}
            for parent in parents:
                if parent.startswith(PRESET_PREFIX):
                    layer = self.preset(parent[len(PRESET_PREFIX) :], referrer=key)
                elif base_dir is None:
                    raise ConfigError(
                        f"{key}: a preset may only extend other presets ('preset:<name>'), "
                        f"got {parent!r}"
                    )
                else:
                    layer = self.file(base_dir / Path(parent).expanduser(), referrer=key)
                merged = deep_merge(merged, layer)
            return deep_merge(merged, data)
        finally:
            self.stack.pop()


def _parse_value(raw: str) -> Any:
    """A TOML value, or the raw text as a string when it is not valid TOML."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()


def _check_override_path(keys: list[str], item: str) -> None:
    """Refuse a --set path that names no field, with the nearest valid name; an old key name
    is translated in place (with a deprecation line)."""
    cls: type | None = None
    for depth, key in enumerate(keys):
        if cls is not None:
            key = keys[depth] = renamed_key(cls, key, ".".join(keys[:depth]))
        options = list(SECTIONS) if cls is None else [f.name for f in dataclasses.fields(cls)]
        path = ".".join(keys[: depth + 1])
        if key not in options:
            what = "section" if cls is None else "key"
            table, name = (".".join(keys[:depth]), key) if depth else ("", ".".join(keys))
            raise ConfigError(f"--set {item!r}: unknown {what} {path}{key_hint(table, name)}")
        if cls is None:
            cls = SECTIONS[key]
            continue
        kind = dataclass_in(typing.get_type_hints(cls)[key])
        if depth + 1 < len(keys):
            if kind is None or kind[0] == "list":
                raise ConfigError(f"--set {item!r}: {path} is not a table")
            cls = kind[1]


def parse_override(item: str) -> dict[str, Any]:
    """``section.key=value`` → a nested dict to merge; the value is parsed as TOML."""
    if "=" not in item:
        raise ConfigError(
            f"--set {item!r}: expected section.key=value (e.g. training.max_steps=30)"
        )
    path, raw = item.split("=", 1)
    keys = [k.strip() for k in path.strip().split(".")]
    if len(keys) < 2 or not all(keys):
        raise ConfigError(
            f"--set {item!r}: the key must be a dotted path like section.key, got "
            f"{path.strip()!r}{sectionless_hint(keys[0]) if len(keys) == 1 else ''}"
        )
    _check_override_path(keys, item)
    value: Any = _parse_value(raw)
    for key in reversed(keys):
        value = {key: value}
    return value


def load_config(
    files: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    preset: str | None = None,
    default_preset: bool = True,
) -> RunConfig:
    """Layer a preset, the files, then the --set overrides, and return the validated
    `RunConfig`. The preset is `preset` when given; otherwise, when no file extends a preset,
    'tiny' (unless `default_preset` is False: a complete saved config.toml needs no base).
    Every problem is a ConfigError naming its source."""
    if isinstance(files, (str, Path)):
        files = [files]
    if isinstance(overrides, str):
        overrides = [overrides]
    layerer = _Layerer()
    merged: dict[str, Any] = layerer.preset(preset) if preset is not None else {}
    for path in files:
        merged = deep_merge(merged, layerer.file(path))
    layered_on = None
    if preset is not None:
        layered_on = f"preset {preset} (--preset)"
    elif layerer.presets:
        layered_on = f"preset {layerer.presets[-1]} (extended by the config)"
    elif default_preset:
        merged = deep_merge(layerer.preset(DEFAULT_PRESET), merged)
        layered_on = f"preset {DEFAULT_PRESET} (the default: " + (
            "no config file extends a preset)" if files else "no config file given)"
        )
    explicit = set(layerer.file_keys)
    for item in overrides:
        override = parse_override(item)
        explicit |= {(section, name) for section, table in override.items() for name in table}
        merged = deep_merge(merged, override)
    merged = _tokenizer_of_corpus(merged, ("data", "tokenizer") in explicit)
    if ("model", "vocab_size") not in explicit:
        merged = _vocab_from_tokenizer(merged)
    cfg = RunConfig.from_dict(merged)
    # RunConfig.layered_on is a ClassVar only so that it is no dataclass field (set per instance)
    cfg.layered_on = layered_on  # type: ignore[misc]
    return cfg


def _tokenizer_of_corpus(merged: dict[str, Any], named: bool) -> dict[str, Any]:
    """A prepared corpus brings its tokenizer: data.tokenizer set to the tokenizer.json of a
    prepared ``data.source`` (the directory, or one of its split files) when no config file
    or --set names one (`named`; a preset's value gives way). One that is named must be the
    corpus's, which reading the corpus checks (`data/prepared.py`), so a finished run's
    config still loads for inference after its corpus changed."""
    data = merged.get("data")
    source = data.get("source") if isinstance(data, Mapping) else None
    if named or not isinstance(source, str) or source.startswith(BUILTIN_PREFIX):
        return merged  # a non-string is refused, with its key, by DataConfig.validate
    corpus = prepared_directory(Path(source).expanduser())
    if corpus is None:
        return merged
    own = corpus_tokenizer(corpus)
    return deep_merge(merged, {"data": {"tokenizer": str(own) if own else BYTES}})


def _vocab_from_tokenizer(merged: dict[str, Any]) -> dict[str, Any]:
    """model.vocab_size set to the size of a Hugging Face ``data.tokenizer`` (used when no
    config file or --set gives model.vocab_size; a preset's value gives way)."""
    data = merged.get("data")
    name = data.get("tokenizer", BYTES) if isinstance(data, Mapping) else BYTES
    if not isinstance(name, str) or name == BYTES:
        return merged  # a non-string is refused, with its key, by DataConfig.validate
    size = load_tokenizer(name).vocab_size
    return deep_merge(merged, {"model": {"vocab_size": size}})


# --------------------------------------------------------------------------- writing


def _drop_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_none(v) for v in value]
    return value


def dump_toml(cfg: RunConfig) -> str:
    """The config as TOML text; None values are left out (TOML has no null; they default)."""
    return tomli_w.dumps(_drop_none(cfg.to_dict()))


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write `dump_toml(cfg)` atomically, so a crash never leaves a half-written config."""
    text = dump_toml(cfg)
    with atomic_write(path, "w") as handle:
        handle.write(text)


def load_train_config(
    continued: RunDir | None, configs: list[str], overrides: list[str], preset: str | None
) -> RunConfig:
    """The config of `bdh-train train`. A fresh run's (`continued` None) is built from the
    preset, `configs` and `overrides`. A resume's is the saved config of `continued` (the run
    directory, or the checkpoint directory a run continues from), naming its own tokenizer
    copy when it moved and no --config is given, under `configs` and `overrides`, which may
    change everything but the model and the data (`RESUME_FIXED`)."""
    if continued is None:
        return load_config(configs, overrides, preset)
    continued.check_resumable()
    moved = [] if configs else continued.moved_tokenizer_override()
    saved = load_config([continued.config], moved, default_preset=False)
    cfg = load_config([continued.config, *configs], [*moved, *overrides], default_preset=False)
    _refuse_redefinition(saved, cfg, continued.config)
    _refuse_a_moved_corpus(saved, cfg, continued.config)
    return cfg


def _refuse_a_moved_corpus(saved: RunConfig, cfg: RunConfig, where: Path) -> None:
    """ConfigError when the corpus the run's config names (and the resume does not rename)
    is no longer there: it says how to name where it went."""
    source = saved.data.source
    if source != cfg.data.source or not saved.data.is_a_path:
        return
    if not Path(source).exists():
        raise ConfigError(
            f"data.source '{source}' of the run's config ({where}) does not exist: if the "
            "run's corpus moved, resume with --set data.source=WHERE_IT_IS_NOW (the same "
            "data; the checkpoint's loader checks it is)"
        )


RESUME_FIXED = ("model", "data")
"""The sections a resume keeps as the run has them: the model and the data it trains on."""
RESUME_MAY_CHANGE = ("data.source", "data.tokenizer")
"""Keys of those sections a resume may still set: where a moved corpus or tokenizer now is
(the checkpoint's tokenizer fingerprint is checked on resume)."""


def _refuse_redefinition(saved: RunConfig, cfg: RunConfig, where: Path) -> None:
    """ConfigError naming the first key of `RESUME_FIXED` that `cfg` sets otherwise than the
    run's saved config."""
    before, after = saved.to_dict(), cfg.to_dict()
    for section in RESUME_FIXED:
        for key, was, now in _differences(before[section], after[section], section):
            if key in RESUME_MAY_CHANGE:
                continue
            raise ConfigError(
                f"{key} is {was!r} in the run's config ({where}) but {now!r} here: a resume "
                "continues the same model on the same data; to train from these weights with "
                "another definition, start a new run with checkpoint.init_from = "
                f"'{where.parent}' (and --run-dir NEW)"
            )


def _differences(before: Any, after: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, before, after) of every leaf where two config tables differ."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after)):
            found += _differences(before.get(key), after.get(key), f"{prefix}.{key}")
        return found
    return [] if before == after else [(prefix, before, after)]
