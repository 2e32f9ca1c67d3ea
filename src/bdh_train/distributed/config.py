"""The `[parallel]` config section (`ParallelConfig`) and the pipeline-shape rules it
validates: schedule names, virtual stages, microbatches, layers per stage, what a pipeline
or sharding cannot be combined with. One home for each rule: config validation applies them
before a run directory is written, and `planner.build_pipeline_plan` (so `bdh-train plan`)
and the pipeline runner apply the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from bdh_train import checks
from bdh_train.errors import ConfigError

# "1f1b" is the non-interleaved 1F1B: the interleaved rules with one virtual stage per rank.
SCHEDULES: tuple[str, ...] = ("gpipe", "interleaved_1f1b", "1f1b")
MULTI_STAGE_SCHEDULES: tuple[str, ...] = ("gpipe", "interleaved_1f1b")
"""Schedules that run several virtual stages per rank (gpipe as torch's looped BFS)."""
SHARD_MODES: tuple[str, ...] = ("none", "fsdp")
"""`parallel.shard`: whole replicas, or FSDP2 parameter sharding over the data-parallel ranks."""


@dataclass
class ParallelConfig:
    """`[parallel]`: data parallel x pipeline parallel over layer stages. The torchrun
    processes form a ``data_parallel`` x ``pipeline_stages`` mesh: each data-parallel replica
    is one pipeline of ``pipeline_stages`` processes and takes its rows of every batch. With
    ``emulate`` the plan's microbatches run in one process (same numbers as the real
    pipeline)."""

    pipeline_stages: int = 1
    """Pipeline ranks the layers are split over (torchrun processes); 1 = no pipeline."""
    virtual_stages_per_rank: int = 1
    """Layer ranges per rank; more than 1 needs a multi-stage schedule."""
    microbatches: int = 1
    """Microbatches each micro-batch is split into for the pipeline schedule."""
    schedule: str = "1f1b"
    """'gpipe', '1f1b' or 'interleaved_1f1b'."""
    emulate: bool = False
    """Run the pipeline plan in one process (same numbers, for testing a plan)."""
    collective_timeout_s: float = 300.0
    """Seconds a collective (gradient all-reduce, stop vote, checkpoint gather) waits for the
    other processes before the run fails, instead of hanging."""
    data_parallel: int = 0
    """Data-parallel replicas; 0 = the torchrun processes / pipeline_stages.
    Set it to have a wrong process count refused."""
    shard: str = "none"
    """'none' (every data-parallel process holds the whole model, gradients all-reduced once
    per step) or 'fsdp' (FSDP2 fully_shard over the data-parallel processes: each holds 1/W of
    the parameters, gradients and optimizer state; the model is gathered once per forward and
    its gradients reduce-scattered every backward; checkpoints are written shard by shard)."""

    def validate(self, prefix: str = "parallel") -> ParallelConfig:
        checks.positive_int(f"{prefix}.pipeline_stages", self.pipeline_stages)
        checks.int_in(
            f"{prefix}.virtual_stages_per_rank",
            self.virtual_stages_per_rank,
            1,
            self.pipeline_stages,
            f"{prefix}.pipeline_stages",
        )
        checks.positive_int(f"{prefix}.microbatches", self.microbatches)
        checks.nonneg_int(f"{prefix}.data_parallel", self.data_parallel)
        checks.choice(f"{prefix}.schedule", self.schedule, SCHEDULES)
        checks.choice(f"{prefix}.shard", self.shard, SHARD_MODES)
        if self.shard == "fsdp" and self.pipeline_stages > 1:
            raise ConfigError(
                f"{prefix}.shard='fsdp' shards the model over data-parallel processes and "
                f"cannot be combined with a pipeline ({prefix}.pipeline_stages="
                f"{self.pipeline_stages}); set {prefix}.pipeline_stages=1 or "
                f"{prefix}.shard='none'"
            )
        checks.boolean(f"{prefix}.emulate", self.emulate)
        checks.number(
            f"{prefix}.collective_timeout_s", self.collective_timeout_s, low=0.0, low_open=True
        )
        if self.virtual_stages_per_rank > 1 and self.schedule not in MULTI_STAGE_SCHEDULES:
            raise ConfigError(
                f"{prefix}.virtual_stages_per_rank={self.virtual_stages_per_rank} needs "
                f"{prefix}.schedule in {', '.join(map(repr, MULTI_STAGE_SCHEDULES))}; "
                f"{self.schedule!r} runs one stage per rank"
            )
        return self

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(data-parallel replicas, pipeline stages) of `world_size` processes; ConfigError
        when they do not make the mesh (emulated pipelines use no processes)."""
        stages = 1 if self.emulate else self.pipeline_stages
        if self.data_parallel:
            if self.data_parallel * stages != world_size:
                raise ConfigError(
                    f"parallel.data_parallel={self.data_parallel} x parallel.pipeline_stages="
                    f"{stages} needs {self.data_parallel * stages} processes (torchrun "
                    f"--nproc-per-node ...), got {world_size}"
                )
            return self.data_parallel, stages
        if world_size % stages:
            raise ConfigError(
                f"parallel.pipeline_stages={stages} needs a multiple of {stages} processes "
                f"(one pipeline per data-parallel replica), got {world_size}; or set "
                "parallel.emulate=true to run the plan's microbatches in one process"
            )
        return world_size // stages, stages

    def check_shard(self, compile_mode: str, profile: str, prefix: str = "parallel") -> None:
        """What a sharded (FSDP) run cannot do yet: the compiled layers and the detail
        profiler's probes run the model outside FSDP's gather hooks; the fused gate is not
        tested under FSDP."""
        if self.shard != "fsdp":
            return
        if compile_mode != "off":
            raise ConfigError(
                f"{prefix}.shard='fsdp' does not support training.compile={compile_mode!r} (the "
                "compiled layer is not traced through FSDP's parameter gathering, and the fused "
                f"gate is untested under it); set training.compile='off' or {prefix}.shard='none'"
            )
        if profile == "detail":
            raise ConfigError(
                f"{prefix}.shard='fsdp' does not support training.profile='detail' (its probes "
                "run parts of the model outside FSDP's parameter gathering); use "
                f"training.profile='step' or {prefix}.shard='none'"
            )

    def check_fill(self, prefix: str = "parallel") -> None:
        """1F1B schedules fill the pipeline before their steady state."""
        if self.schedule != "gpipe" and self.microbatches < self.pipeline_stages:
            raise ConfigError(
                f"{prefix}.microbatches must be >= {prefix}.pipeline_stages "
                f"({self.pipeline_stages}) with {prefix}.schedule={self.schedule!r} (1F1B "
                f"fills the pipeline before its steady state), got {self.microbatches}"
            )

    @property
    def total_virtual_stages(self) -> int:
        return self.pipeline_stages * self.virtual_stages_per_rank

    def check_model(self, n_layer: int, prefix: str = "parallel") -> None:
        """Every virtual stage needs at least one of the model's layers."""
        if self.total_virtual_stages > n_layer:
            raise ConfigError(
                f"model.n_layer must be >= {prefix}.pipeline_stages * "
                f"{prefix}.virtual_stages_per_rank ({self.total_virtual_stages}) so every "
                f"stage holds a layer, got {n_layer}"
            )

    def check_training(
        self, batch_size: int, tbptt_chunk_size: int, streaming: bool, prefix: str = "parallel"
    ) -> None:
        """What a pipeline needs of the train step: whole batches, no carried state, and (for
        the multi-process runner) equal microbatches in whole schedule rounds."""
        if self.microbatches > batch_size:
            raise ConfigError(
                f"{prefix}.microbatches must be <= training.batch_size ({batch_size}), "
                f"got {self.microbatches}"
            )
        if self.pipeline_stages == 1:
            return
        if tbptt_chunk_size:
            raise ConfigError(
                f"pipeline parallelism ({prefix}.pipeline_stages={self.pipeline_stages}) does "
                "not support truncated BPTT (each stage runs a fresh state per microbatch); "
                f"set training.tbptt_chunk_size=0, got {tbptt_chunk_size}"
            )
        if streaming:
            raise ConfigError(
                f"pipeline parallelism ({prefix}.pipeline_stages={self.pipeline_stages}) does "
                "not support streamed state (a stage keeps no state between microbatches or "
                "steps); set training.tbptt_persist_across_steps=false, "
                "training.min_logical_block_size=0 and training.stream_documents='fixed'"
            )
        self.check_fill(prefix)
        if self.emulate:
            return
        if self.data_parallel > 1:
            if batch_size % self.data_parallel:
                raise ConfigError(
                    f"training.batch_size={batch_size} does not split over "
                    f"{prefix}.data_parallel={self.data_parallel} replicas"
                )
            batch_size //= self.data_parallel
        check_equal_microbatches(batch_size, self.microbatches)
        rounds = max(1, self.microbatches // self.pipeline_stages)
        if self.schedule == "interleaved_1f1b" and self.microbatches % rounds:
            raise ConfigError(
                f"{prefix}.microbatches={self.microbatches} must be a multiple of its number "
                f"of rounds max(1, microbatches // {prefix}.pipeline_stages) = {rounds} with "
                f"{prefix}.schedule='interleaved_1f1b' (torch's ScheduleInterleaved1F1B runs "
                f"whole rounds); a multiple of {prefix}.pipeline_stages always works"
            )


def check_equal_microbatches(batch_size: int, microbatches: int) -> None:
    """torch.distributed.pipelining sizes its receive buffers from the first microbatch, so
    the multi-process runner needs a batch that splits into equal microbatches."""
    if batch_size % microbatches:
        raise ConfigError(
            f"training.batch_size={batch_size} must be a multiple of "
            f"parallel.microbatches={microbatches}: torch.distributed.pipelining splits the "
            "batch into equal microbatches (its receive buffers are shaped by the first one)"
        )
