"""The run configuration: one dataclass per TOML section, layered from presets, files and
`--set` overrides, and validated up front so a bad value fails before any training starts.

Layering (`load_config`), lowest priority first:

1. the dataclass defaults, or a preset (``tiny`` | ``small`` | ``pathway``, shipped in
   ``bdh_train/presets``). When neither a preset nor any file is given, the preset is ``tiny``
   (a CPU demo), so ``bdh-train train`` with no arguments does something useful;
2. each file in order; a file may say ``extends = ["base.toml", "preset:tiny"]`` (paths relative
   to that file), and its own values override what it extends;
3. each ``--set section.key=value`` override, the value parsed as a TOML value (a bare word
   that is not valid TOML is taken as a string).

Tables are deep-merged; lists (``optimizer.betas``, ``training.module_lr_scales``) are replaced
whole. Unknown keys anywhere are errors that suggest the nearest valid name.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import sys
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from bdh_train.distributed.planner import SCHEDULES as PLANNER_SCHEDULES
from bdh_train.errors import ConfigError
from bdh_train.model.config import BDHConfig
from bdh_train.model.groups import TARGETS as GRADIENT_SCALE_TARGETS
from bdh_train.utils import atomic_write, build_dataclass, suggest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

PRESETS = ("tiny", "small", "pathway")
DEFAULT_PRESET = "tiny"
"""The preset used when `load_config` gets neither a preset nor a file."""

BUILTIN_SOURCES = ("pydoc",)
"""Names accepted after ``builtin:`` in ``data.source``."""
NCA_SOURCE = "nca"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16")
LR_SCHEDULES = ("constant", "cosine")
PIPELINE_SCHEDULES = PLANNER_SCHEDULES
LR_SCALE_TARGETS = GRADIENT_SCALE_TARGETS  # the parameter groups of spec §6
EXTENDS_KEY = "extends"
PRESET_PREFIX = "preset:"


# --------------------------------------------------------------------------- value checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _int_at_least(path: str, value: Any, low: int, what: str) -> None:
    if not _is_int(value) or value < low:
        raise ConfigError(f"{path} must be a {what}, got {value!r}")


def _positive_int(path: str, value: Any) -> None:
    _int_at_least(path, value, 1, "positive integer")


def _nonneg_int(path: str, value: Any) -> None:
    _int_at_least(path, value, 0, "non-negative integer")


def _nonneg_interval(path: str, value: Any) -> None:
    _int_at_least(path, value, 0, "non-negative integer (0 disables it)")


def _range_text(low: float, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        if low == 0:
            return "a positive number" if low_open else "a non-negative number"
        return f"a number {'>' if low_open else '>='} {low:g}"
    return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def _number(path: str, value: Any, *, low: float, high: float | None = None,
            low_open: bool = False, high_open: bool = True) -> None:
    """A finite int or float within [low, high) by default (ends open or closed as asked)."""
    ok = _is_number(value) and (value > low if low_open else value >= low)
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ConfigError(
            f"{path} must be {_range_text(low, high, low_open, high_open)}, got {value!r}"
        )


def _boolean(path: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{path} must be true or false, got {value!r}")


def _string(path: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"{path} must be a string, got {value!r}")


def _choice(path: str, value: Any, allowed: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in allowed:
        hint = suggest(value, allowed) if isinstance(value, str) else ""
        raise ConfigError(
            f"{path} must be one of {', '.join(map(repr, allowed))}, got {value!r}{hint}"
        )


# --------------------------------------------------------------------------- sections


@dataclass
class NcaDataConfig:
    """Options of the synthetic neural-cellular-automaton corpus (``data.source = "nca"``).

    Held and validated here; the generator lives with the data code.
    """

    grid_size: int = 8
    state_count: int = 2
    steps: int = 16
    patch_size: int = 2
    seed: int = 0
    rule_count: int = 4

    def validate(self, prefix: str = "data.nca") -> NcaDataConfig:
        _positive_int(f"{prefix}.grid_size", self.grid_size)
        _int_at_least(f"{prefix}.state_count", self.state_count, 2, "integer >= 2")
        _positive_int(f"{prefix}.steps", self.steps)
        _positive_int(f"{prefix}.patch_size", self.patch_size)
        _nonneg_int(f"{prefix}.seed", self.seed)
        _positive_int(f"{prefix}.rule_count", self.rule_count)
        if self.grid_size % self.patch_size:
            raise ConfigError(
                f"{prefix}.grid_size must be a multiple of {prefix}.patch_size "
                f"({self.patch_size}), got {self.grid_size}"
            )
        return self


@dataclass
class DataConfig:
    """Where tokens come from. The vocabulary size is the model's (``model.vocab_size``)."""

    source: str = "builtin:pydoc"
    """``builtin:<name>``, ``nca``, or a filesystem path (a text file or a directory)."""
    val_fraction: float = 0.1
    nca: NcaDataConfig = field(default_factory=NcaDataConfig)

    def validate(self, prefix: str = "data") -> DataConfig:
        _string(f"{prefix}.source", self.source)
        if not self.source:
            raise ConfigError(
                f"{prefix}.source must be 'builtin:<name>', 'nca' or a path, got ''"
            )
        if self.source.startswith("builtin:"):
            name = self.source[len("builtin:"):]
            if name not in BUILTIN_SOURCES:
                raise ConfigError(
                    f"{prefix}.source names an unknown builtin corpus {name!r}; known: "
                    f"{', '.join('builtin:' + b for b in BUILTIN_SOURCES)}"
                    f"{suggest(name, BUILTIN_SOURCES)}"
                )
        _number(f"{prefix}.val_fraction", self.val_fraction, low=0.0, high=1.0)
        self.nca.validate(f"{prefix}.nca")
        return self


@dataclass
class ModuleLrScaleSchedule:
    """Move a module group's lr scale from `ModuleLrScale.scale` to `final_scale` linearly
    between two fractions of training (e.g. unfreeze a transferred backbone gradually)."""

    final_scale: float = 1.0
    start_fraction: float = 0.0
    end_fraction: float = 1.0

    def validate(self, prefix: str) -> ModuleLrScaleSchedule:
        _number(f"{prefix}.final_scale", self.final_scale, low=0.0)
        _number(f"{prefix}.start_fraction", self.start_fraction, low=0.0, high=1.0,
                high_open=False)
        _number(f"{prefix}.end_fraction", self.end_fraction, low=0.0, high=1.0, high_open=False)
        if self.start_fraction > self.end_fraction:
            raise ConfigError(
                f"{prefix}.start_fraction ({self.start_fraction}) must be <= "
                f"{prefix}.end_fraction ({self.end_fraction})"
            )
        return self


@dataclass
class ModuleLrScale:
    """Multiply the learning rate of one parameter group (`target`) by `scale`."""

    target: str = "other_backbone"
    scale: float = 1.0
    schedule: ModuleLrScaleSchedule | None = None

    def validate(self, prefix: str) -> ModuleLrScale:
        _choice(f"{prefix}.target", self.target, LR_SCALE_TARGETS)
        _number(f"{prefix}.scale", self.scale, low=0.0)
        if self.schedule is not None:
            if not isinstance(self.schedule, ModuleLrScaleSchedule):
                raise ConfigError(f"{prefix}.schedule must be a table, got {self.schedule!r}")
            self.schedule.validate(f"{prefix}.schedule")
        return self


@dataclass
class InitTransferConfig:
    """How to treat weights loaded with ``checkpoint.init_from`` during the first steps."""

    backbone_grad_scale: float | None = None
    """Multiply the backbone's gradients by this (None: no scaling)."""
    backbone_grad_scale_steps: int = 0
    """For how many optimizer steps the scaling applies (0: not at all, as in the seed)."""
    preserve_fresh_decoder: bool = False
    preserve_fresh_norm: bool = False

    def validate(self, prefix: str = "training.init_transfer") -> InitTransferConfig:
        if self.backbone_grad_scale is not None:
            _number(f"{prefix}.backbone_grad_scale", self.backbone_grad_scale, low=0.0)
        _nonneg_int(f"{prefix}.backbone_grad_scale_steps", self.backbone_grad_scale_steps)
        _boolean(f"{prefix}.preserve_fresh_decoder", self.preserve_fresh_decoder)
        _boolean(f"{prefix}.preserve_fresh_norm", self.preserve_fresh_norm)
        return self


@dataclass
class TrainingConfig:
    """The train loop. An interval (``*_every``) of 0 disables that action."""

    block_size: int = 512
    batch_size: int = 32
    tbptt_chunk_size: int = 0
    """Truncated BPTT chunk length inside a block; 0 = off (backprop the whole block)."""
    tbptt_backprop_chunks: int = 1
    """How many consecutive chunks one backward pass spans."""
    tbptt_persist_across_steps: bool = False
    """Carry the recurrent state from one optimizer step's block to the next (streaming)."""
    min_logical_block_size: int = 0
    """Logical sequence length streamed over consecutive blocks; 0 = block_size."""
    gradient_accumulation_steps: int = 1
    target_tokens_per_step: int = 0
    """Tokens per optimizer step; 0 = unset. When set, gradient accumulation is derived."""
    max_steps: int = 3000
    seed: int = 1337
    log_every: int = 100
    eval_every: int = 500
    eval_steps: int = 20
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    """How many periodic checkpoints to keep; 0 keeps all."""
    device: str = "auto"
    dtype: str = "float32"
    compile: bool = False
    max_consecutive_skips: int = 5
    """Abort after this many consecutive steps skipped for non-finite loss/gradients."""
    profile: bool = False
    module_lr_scales: list[ModuleLrScale] = field(default_factory=list)
    init_transfer: InitTransferConfig = field(default_factory=InitTransferConfig)

    @property
    def logical_block_size(self) -> int:
        """The logical sequence length (min_logical_block_size, or block_size when 0)."""
        return self.min_logical_block_size or self.block_size

    @property
    def streaming(self) -> bool:
        """Whether recurrent state flows across blocks (persisted or logical > block)."""
        return self.tbptt_persist_across_steps or self.logical_block_size > self.block_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step, derived from target_tokens_per_step when set."""
        if self.target_tokens_per_step:
            return self.target_tokens_per_step // (self.block_size * self.batch_size)
        return self.gradient_accumulation_steps

    @property
    def tokens_per_step(self) -> int:
        return self.accumulation_steps * self.block_size * self.batch_size

    def validate(self, prefix: str = "training") -> TrainingConfig:
        p = prefix
        _positive_int(f"{p}.block_size", self.block_size)
        _positive_int(f"{p}.batch_size", self.batch_size)
        _nonneg_int(f"{p}.tbptt_chunk_size", self.tbptt_chunk_size)
        _positive_int(f"{p}.tbptt_backprop_chunks", self.tbptt_backprop_chunks)
        _boolean(f"{p}.tbptt_persist_across_steps", self.tbptt_persist_across_steps)
        _nonneg_int(f"{p}.min_logical_block_size", self.min_logical_block_size)
        _positive_int(f"{p}.gradient_accumulation_steps", self.gradient_accumulation_steps)
        _nonneg_int(f"{p}.target_tokens_per_step", self.target_tokens_per_step)
        _positive_int(f"{p}.max_steps", self.max_steps)
        _nonneg_int(f"{p}.seed", self.seed)
        for name in ("log_every", "eval_every", "checkpoint_every"):
            _nonneg_interval(f"{p}.{name}", getattr(self, name))
        _positive_int(f"{p}.eval_steps", self.eval_steps)
        _nonneg_int(f"{p}.keep_checkpoints", self.keep_checkpoints)
        _choice(f"{p}.device", self.device, DEVICES)
        _choice(f"{p}.dtype", self.dtype, DTYPES)
        _boolean(f"{p}.compile", self.compile)
        _nonneg_int(f"{p}.max_consecutive_skips", self.max_consecutive_skips)
        _boolean(f"{p}.profile", self.profile)

        if self.tbptt_chunk_size and self.tbptt_chunk_size >= self.block_size:
            raise ConfigError(
                f"{p}.tbptt_chunk_size must be 0 (off) or less than {p}.block_size "
                f"({self.block_size}), got {self.tbptt_chunk_size}"
            )
        if self.min_logical_block_size and self.min_logical_block_size % self.block_size:
            raise ConfigError(
                f"{p}.min_logical_block_size must be 0 or a multiple of {p}.block_size "
                f"({self.block_size}), got {self.min_logical_block_size}"
            )
        if self.target_tokens_per_step:
            if self.gradient_accumulation_steps != 1:
                raise ConfigError(
                    f"set either {p}.target_tokens_per_step or "
                    f"{p}.gradient_accumulation_steps, not both (got "
                    f"{self.target_tokens_per_step} and {self.gradient_accumulation_steps})"
                )
            micro = self.block_size * self.batch_size
            if self.target_tokens_per_step % micro:
                raise ConfigError(
                    f"{p}.target_tokens_per_step must be a multiple of {p}.block_size * "
                    f"{p}.batch_size ({micro}), got {self.target_tokens_per_step}"
                )

        if not isinstance(self.module_lr_scales, list):
            raise ConfigError(
                f"{p}.module_lr_scales must be a list of tables, got {self.module_lr_scales!r}"
            )
        seen: dict[str, int] = {}
        for i, item in enumerate(self.module_lr_scales):
            where = f"{p}.module_lr_scales[{i}]"
            if not isinstance(item, ModuleLrScale):
                raise ConfigError(f"{where} must be a table, got {item!r}")
            item.validate(where)
            if item.target in seen:
                raise ConfigError(
                    f"{where}.target {item.target!r} repeats "
                    f"{p}.module_lr_scales[{seen[item.target]}]; give each target once"
                )
            seen[item.target] = i
        self.init_transfer.validate(f"{p}.init_transfer")
        return self


@dataclass
class OptimizerConfig:
    """AdamW with optional warmup + cosine decay and gradient-norm clipping."""

    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr: float = 0.0
    """The floor of the cosine schedule (ignored by 'constant')."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this; 0 = off."""

    def validate(self, prefix: str = "optimizer") -> OptimizerConfig:
        _number(f"{prefix}.lr", self.lr, low=0.0, low_open=True)
        betas = self.betas
        if (
            not isinstance(betas, (list, tuple))
            or len(betas) != 2
            or not all(_is_number(b) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise ConfigError(
                f"{prefix}.betas must be a list of two numbers in [0, 1), got {betas!r}"
            )
        _number(f"{prefix}.eps", self.eps, low=0.0, low_open=True)
        _number(f"{prefix}.weight_decay", self.weight_decay, low=0.0)
        _nonneg_int(f"{prefix}.warmup_steps", self.warmup_steps)
        _choice(f"{prefix}.schedule", self.schedule, LR_SCHEDULES)
        _number(f"{prefix}.min_lr", self.min_lr, low=0.0)
        if self.schedule == "cosine" and self.min_lr > self.lr:
            raise ConfigError(
                f"{prefix}.min_lr must be <= {prefix}.lr ({self.lr}) for the cosine schedule, "
                f"got {self.min_lr}"
            )
        _number(f"{prefix}.grad_clip_norm", self.grad_clip_norm, low=0.0)
        return self


@dataclass
class CheckpointConfig:
    """Where the weights start from. ``resume`` (set by ``--resume``) wins over ``init_from``."""

    init_from: str = ""
    """"" = fresh init; else a run dir, a checkpoint dir, or an official ``.pt`` state_dict."""
    resume: str = ""
    """"" = start a new run; else the run or checkpoint directory to continue exactly."""

    def validate(self, prefix: str = "checkpoint") -> CheckpointConfig:
        _string(f"{prefix}.init_from", self.init_from)
        _string(f"{prefix}.resume", self.resume)
        return self


@dataclass
class ParallelConfig:
    """Pipeline parallelism; ``emulate`` runs the plan's microbatching in one process."""

    pipeline_stages: int = 1
    virtual_stages_per_rank: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    emulate: bool = False

    def validate(self, prefix: str = "parallel") -> ParallelConfig:
        _positive_int(f"{prefix}.pipeline_stages", self.pipeline_stages)
        _positive_int(f"{prefix}.virtual_stages_per_rank", self.virtual_stages_per_rank)
        _positive_int(f"{prefix}.microbatches", self.microbatches)
        _choice(f"{prefix}.schedule", self.schedule, PIPELINE_SCHEDULES)
        _boolean(f"{prefix}.emulate", self.emulate)
        if self.virtual_stages_per_rank > self.pipeline_stages:
            raise ConfigError(
                f"{prefix}.virtual_stages_per_rank must be in [1, {prefix}.pipeline_stages "
                f"({self.pipeline_stages})], got {self.virtual_stages_per_rank}"
            )
        if self.virtual_stages_per_rank > 1 and self.schedule != "interleaved_1f1b":
            raise ConfigError(
                f"{prefix}.virtual_stages_per_rank={self.virtual_stages_per_rank} needs "
                f"{prefix}.schedule='interleaved_1f1b', got {self.schedule!r}"
            )
        return self


SECTIONS: dict[str, type] = {
    "model": BDHConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "checkpoint": CheckpointConfig,
    "parallel": ParallelConfig,
}


@dataclass
class RunConfig:
    """Everything a run needs; each field is one TOML section."""

    model: BDHConfig = field(default_factory=BDHConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> RunConfig:
        """Check every field, then the rules that span sections. Returns self."""
        self.model.validate("model")
        self.data.validate("data")
        self.training.validate("training")
        self.optimizer.validate("optimizer")
        self.checkpoint.validate("checkpoint")
        self.parallel.validate("parallel")

        tr, par = self.training, self.parallel
        if par.microbatches > tr.batch_size:
            raise ConfigError(
                f"parallel.microbatches must be <= training.batch_size ({tr.batch_size}), "
                f"got {par.microbatches}"
            )
        if par.pipeline_stages > 1:
            if tr.tbptt_chunk_size:
                raise ConfigError(
                    "pipeline parallelism (parallel.pipeline_stages="
                    f"{par.pipeline_stages}) does not support truncated BPTT; set "
                    f"training.tbptt_chunk_size=0, got {tr.tbptt_chunk_size}"
                )
            if tr.streaming:
                raise ConfigError(
                    "pipeline parallelism (parallel.pipeline_stages="
                    f"{par.pipeline_stages}) does not support streamed state; set "
                    "training.tbptt_persist_across_steps=false and "
                    "training.min_logical_block_size=0 (got "
                    f"{tr.tbptt_persist_across_steps} and {tr.min_logical_block_size})"
                )
            layers_needed = par.pipeline_stages * par.virtual_stages_per_rank
            if self.model.n_layer < layers_needed:
                raise ConfigError(
                    f"model.n_layer must be >= parallel.pipeline_stages * "
                    f"parallel.virtual_stages_per_rank ({layers_needed}) so every stage holds "
                    f"a layer, got {self.model.n_layer}"
                )
        head = self.model.language_head
        if self.data.source == NCA_SOURCE and head.type == "nca_factorized_patch":
            for name in ("state_count", "patch_size"):
                if getattr(head, name) != getattr(self.data.nca, name):
                    raise ConfigError(
                        f"model.language_head.{name} must equal data.nca.{name} "
                        f"({getattr(self.data.nca, name)}), got {getattr(head, name)}"
                    )
        return self

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (None values kept; `dump_toml` drops them)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], validate: bool = True) -> RunConfig:
        """Build from a nested dict of sections; unknown sections/keys are errors."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a run configuration must be a table, got {data!r}")
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            if name not in SECTIONS:
                raise ConfigError(f"unknown section {name!r}{suggest(name, SECTIONS)}")
            kwargs[name] = _build(SECTIONS[name], value, name)
        cfg = cls(**kwargs)
        return cfg.validate() if validate else cfg


# --------------------------------------------------------------------------- building


def _dataclass_in(hint: Any) -> tuple[str, type] | None:
    """('one' | 'optional' | 'list', cls) when `hint` is a dataclass, Optional or list of one."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "one", hint
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and isinstance(inner[0], type) and dataclasses.is_dataclass(inner[0]):
            return "optional", inner[0]
    if origin is list and len(args) == 1:
        (inner,) = args
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            return "list", inner
    return None


def _build(cls: type, data: Any, prefix: str) -> Any:
    """`utils.build_dataclass`, extended to Optional[dataclass] and list[dataclass] fields."""
    obj = build_dataclass(cls, data, prefix)
    _finish(obj, prefix)
    return obj


def _finish(obj: Any, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = f"{prefix}.{f.name}"
        kind = _dataclass_in(hints[f.name])
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _finish(value, where)
        elif kind and kind[0] == "optional" and isinstance(value, dict):
            setattr(obj, f.name, _build(kind[1], value, where))
        elif kind and kind[0] == "list" and isinstance(value, list):
            setattr(obj, f.name, [
                item if isinstance(item, kind[1]) else _build(kind[1], item, f"{where}[{i}]")
                for i, item in enumerate(value)
            ])


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

    def preset(self, name: str, referrer: str | None = None) -> dict[str, Any]:
        try:
            resource = _preset_resource(name)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (extended by {referrer})" if referrer else str(exc)) from None
        key = f"{PRESET_PREFIX}{name}"
        return self._layer(key, resource.read_text(encoding="utf-8"), None)

    def file(self, path: str | Path, referrer: str | None = None) -> dict[str, Any]:
        path = Path(path).expanduser()
        try:
            resolved = path.resolve()
            text = resolved.read_text(encoding="utf-8")
        except FileNotFoundError:
            by = f" (extended by {referrer})" if referrer else ""
            raise ConfigError(f"config file not found: {path}{by}") from None
        except IsADirectoryError:
            raise ConfigError(f"config path is a directory, not a TOML file: {path}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        return self._layer(str(resolved), text, resolved.parent)

    def _layer(self, key: str, text: str, base_dir: Path | None) -> dict[str, Any]:
        if key in self.stack:
            chain = " -> ".join([*self.stack[self.stack.index(key):], key])
            raise ConfigError(f"config extends cycle: {chain}")
        self.stack.append(key)
        try:
            data = _parse_toml(text, key)
            parents = data.pop(EXTENDS_KEY, [])
            if isinstance(parents, str):
                parents = [parents]
            if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
                raise ConfigError(
                    f"{key}: {EXTENDS_KEY} must be a string or a list of strings, got {parents!r}"
                )
            merged: dict[str, Any] = {}
            for parent in parents:
                if parent.startswith(PRESET_PREFIX):
                    layer = self.preset(parent[len(PRESET_PREFIX):], referrer=key)
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
    """Refuse a --set path that names no field, with the nearest valid name."""
    options: Iterable[str] = SECTIONS
    cls: type | None = None
    for depth, key in enumerate(keys):
        names = list(SECTIONS) if cls is None else [f.name for f in dataclasses.fields(cls)]
        options = names
        path = ".".join(keys[: depth + 1])
        if key not in options:
            what = "section" if cls is None else "key"
            raise ConfigError(f"--set {item!r}: unknown {what} {path}{suggest(key, options)}")
        if cls is None:
            cls = SECTIONS[key]
            continue
        kind = _dataclass_in(typing.get_type_hints(cls)[key])
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
            f"--set {item!r}: the key must be a dotted path like section.key, got {path.strip()!r}"
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
) -> RunConfig:
    """Layer preset (default 'tiny' only when no files are given), files, then --set overrides,
    and return the validated `RunConfig`. Every problem is a ConfigError naming its source."""
    if isinstance(files, (str, Path)):
        files = [files]
    if isinstance(overrides, str):
        overrides = [overrides]
    layerer = _Layerer()
    if preset is None and not files:
        preset = DEFAULT_PRESET
    merged: dict[str, Any] = layerer.preset(preset) if preset is not None else {}
    for path in files:
        merged = deep_merge(merged, layerer.file(path))
    for item in overrides:
        merged = deep_merge(merged, parse_override(item))
    return RunConfig.from_dict(merged)


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
