"""RunConfig: the sections of a run, each owned and validated by its component, and the rules
that span sections."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from bdh_train.data.config import DataConfig
from bdh_train.data.tokenizer import BYTES
from bdh_train.distributed.config import ParallelConfig
from bdh_train.errors import ConfigError
from bdh_train.model.config import BDHConfig
from bdh_train.storage.checkpoint import CheckpointConfig
from bdh_train.train.config import TrainingConfig
from bdh_train.train.metrics import MetricsConfig
from bdh_train.train.optim import OptimizerConfig
from bdh_train.utils import build_dataclass, suggest

SECTIONS: dict[str, type] = {
    "model": BDHConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "checkpoint": CheckpointConfig,
    "parallel": ParallelConfig,
    "metrics": MetricsConfig,
}
"""TOML section -> the component config that owns it."""


@dataclass
class RunConfig:
    """Everything a run needs; each field is one TOML section."""

    model: BDHConfig = field(default_factory=BDHConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    layered_on: ClassVar[str | None] = None
    """Which preset `load_config` layered the config on, in words (set on the instance; not
    a section, never saved); None for a config built directly."""

    def validate(self) -> RunConfig:
        """Check every section, then the rules that span sections. Returns self."""
        for name in SECTIONS:
            getattr(self, name).validate(name)
        tr = self.training
        self.parallel.check_model(self.model.n_layer)
        self.parallel.check_training(tr.batch_size, tr.tbptt_chunk_size, tr.streaming)
        self.parallel.check_shard(tr.compile, tr.profile)
        if self.optimizer.name == "muon" and self.parallel.shard == "fsdp":
            raise ConfigError(
                "optimizer.name = 'muon' orthogonalises whole weight matrices, which "
                "parallel.shard = 'fsdp' splits across processes; set optimizer.name = 'adamw' "
                "or parallel.shard = 'none' (plain data parallel works with Muon)"
            )
        for i, scale in enumerate(tr.gradient_scales):
            if scale.target == "shared_lowrank_decay" and self.model.position != "alibi_learned":
                raise ConfigError(
                    f"training.gradient_scales[{i}].target = 'shared_lowrank_decay' scales the "
                    "learned per-head decay, which only model.position = 'alibi_learned' "
                    f"gives the model; got model.position = {self.model.position!r}"
                )
        head = self.model.language_head
        if head.type == "nca_factorized_patch" and self.data.is_byte_text:
            raise ConfigError(
                "model.language_head.type = 'nca_factorized_patch' predicts patch ids "
                f"(0..{head.patch_vocab - 1}, grids of cells), but data.source = "
                f"{self.data.source!r} is byte text: the head would train on nothing (loss 0, "
                "gradient 0); use data.source = 'nca' or a .bin token file of patch ids, or "
                "model.language_head.type = 'token'"
            )
        if self.data.is_generated and head.type == "nca_factorized_patch":
            for name in ("state_count", "patch_size"):
                if getattr(head, name) != getattr(self.data.nca, name):
                    raise ConfigError(
                        f"model.language_head.{name} must equal data.nca.{name} "
                        f"({getattr(self.data.nca, name)}), got {getattr(head, name)}"
                    )
        if tr.stream_documents == "corpus" and self.model.summary_memory.enabled:
            raise ConfigError(
                "training.stream_documents = 'corpus' resets a row's state at the token where "
                "its next document begins, mid-block included, which model.summary_memory "
                "does not support (its chunks follow positions from the call's start); set "
                "model.summary_memory.enabled = false or training.stream_documents = 'fixed'"
            )
        self.data.check_summary_memory(self.model.summary_memory, self.model.vocab_size)
        self._check_tokenizer_vocab()
        return self

    def _check_tokenizer_vocab(self) -> None:
        """A Hugging Face tokenizer fixes the vocabulary: model.vocab_size must equal its
        size (`load_config` fills it in when no file or --set gives it)."""
        if self.data.tokenizer == BYTES:
            return
        size = self.data.load_tokenizer().vocab_size
        if self.model.vocab_size != size:
            raise ConfigError(
                f"model.vocab_size = {self.model.vocab_size}, but data.tokenizer "
                f"'{self.data.tokenizer}' has {size} ids: set model.vocab_size = {size}, or "
                "leave model.vocab_size out of the config files and --set (it then follows "
                "the tokenizer)"
            )

    def resolved(self) -> RunConfig:
        """A copy whose paths are stored resolved (`DataConfig.resolved_source`), as a run
        writes it to config.toml."""
        data = dataclasses.replace(self.data, source=self.data.resolved_source())
        out = dataclasses.replace(self, data=data)
        # layered_on is a ClassVar only so that it is no dataclass field; it is set per instance
        out.layered_on = self.layered_on  # type: ignore[misc]
        return out

    def notes(self) -> list[str]:
        """Information lines for the start of a run: settings that are valid but behave
        differently from what a user of other BDH implementations may expect."""
        sm, tr = self.model.summary_memory, self.training
        if not sm.enabled:
            return []
        calls = {"training.tbptt_chunk_size": tr.tbptt_chunk_size}
        if tr.streaming:
            calls["training.block_size"] = tr.block_size
        return [
            f"note: {key} ({size}) is not a multiple of model.summary_memory.chunk_tokens "
            f"({sm.chunk_tokens}); summary chunks follow absolute token positions across calls, "
            "so results equal one uninterrupted pass (implementations that restart the chunks "
            "at every call would differ here)"
            for key, size in calls.items()
            if size and size % sm.chunk_tokens
        ]

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (None values kept; the TOML dump drops them)."""
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
            kwargs[name] = build_dataclass(SECTIONS[name], value, name)
        cfg = cls(**kwargs)
        return cfg.validate() if validate else cfg
