"""The components of a training run built from their config sections: the model, the step
executor (one process, DDP, a pipeline replica or FSDP shards), the loader and the
evaluator. The trainer calls these and wires the results together."""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from bdh_train.data.config import DataConfig
from bdh_train.data.loaders import (
    RandomWindowLoader,
    StreamingCorpusLoader,
    StreamingDocumentLoader,
)
from bdh_train.data.tokenizer import ByteTokenizer, Tokenizer
from bdh_train.data.tokens import TokenData
from bdh_train.distributed.config import ParallelConfig
from bdh_train.distributed.env import DistContext, pipeline_mesh
from bdh_train.distributed.planner import build_pipeline_plan
from bdh_train.errors import ConfigError
from bdh_train.model import BDH, BDHConfig
from bdh_train.model.bdh import check_compiler
from bdh_train.train.config import TrainingConfig
from bdh_train.train.evaluate import (
    EvalLoss,
    EvalResult,
    Evaluator,
    text_tokenizer,
    validation_source,
)
from bdh_train.train.memory import check_step_memory, process_share
from bdh_train.train.profile import StepProfiler
from bdh_train.train.reduce import all_reduce_sums
from bdh_train.train.schedules import GradientScaleSchedule
from bdh_train.train.step import LanguageTrainModel, StepExecutor

Loader = RandomWindowLoader | StreamingDocumentLoader | StreamingCorpusLoader


def build_model(
    model: BDHConfig,
    training: TrainingConfig,
    device: torch.device,
    parallel: ParallelConfig | None = None,
    world_size: int = 1,
) -> BDH:
    """A freshly initialised model from the run's seed, with its recompute and compile
    settings. Refused before anything is allocated when one train step of this process (of
    `world_size` on the `parallel` mesh) would not fit in its memory (`check_step_memory`)."""
    check_compiler(training.compile, device)
    share = process_share(model, training, parallel or ParallelConfig(), world_size)
    check_step_memory(model, training, device, share)
    torch.manual_seed(training.seed)
    bdh = BDH(model).to(device)
    bdh.set_recompute(training.recompute)
    bdh.compile_for_training(training.compile)
    return bdh


def build_executor(
    model: BDH,
    training: TrainingConfig,
    parallel: ParallelConfig,
    dist: DistContext,
    device: torch.device,
    gradient_scales: GradientScaleSchedule,
    profiler: StepProfiler | None,
) -> tuple[StepExecutor, DistContext]:
    """The step executor, and the data-parallel group its gradients are reduced over.
    The processes form a data_parallel x pipeline_stages mesh: a pipeline runner sums
    its gradients over its replica's stages, every stage of a replica sees the replica's
    rows, and the replicas reduce over the data-parallel dimension."""
    t, p = training, parallel
    replicas, stages = p.mesh_shape(dist.world_size)
    plan = None
    if p.pipeline_stages > 1:
        plan = build_pipeline_plan(
            model.config.n_layer,
            p.pipeline_stages,
            p.virtual_stages_per_rank,
            p.microbatches,
            p.schedule,
        )
    if plan is not None and stages > 1:
        from bdh_train.distributed.pipeline import PipelineRunner  # ~2 s of imports

        mesh = pipeline_mesh(dist, device.type, replicas, stages)
        return PipelineRunner(model, plan, mesh.stage, mesh.stage_group), mesh.data
    autocast = (
        partial(torch.autocast, device.type, dtype=torch.bfloat16)
        if t.dtype == "bfloat16"
        else contextlib.nullcontext
    )
    step = LanguageTrainModel(
        model,
        tbptt_chunk_size=t.tbptt_chunk_size,
        tbptt_backprop_chunks=t.tbptt_backprop_chunks,
        streaming=t.streaming,
        pipeline_plan=plan,
        gradient_scales=gradient_scales,
        profiler=profiler,
        autocast=autocast,
    )
    return step, dist


def build_loader(
    training: TrainingConfig, data: DataConfig, train_data: TokenData, dp: DistContext
) -> Loader:
    """The training loader `training.stream_documents` names; each data-parallel rank takes
    its rows of the global batch."""
    t, trigger = training, data.summary_trigger()
    rows = (t.seed, dp.rank, dp.world_size)
    if t.stream_documents == "corpus":
        return StreamingCorpusLoader(
            train_data, t.block_size, t.batch_size, *rows, summary_trigger=trigger
        )
    if t.streaming:
        return StreamingDocumentLoader(
            train_data,
            t.block_size,
            t.batch_size,
            t.logical_block_size,
            *rows,
            summary_trigger=trigger,
        )
    return RandomWindowLoader(
        train_data,
        t.block_size,
        t.batch_size,
        *rows,
        accumulation_steps=t.accumulation_steps,
        summary_trigger=trigger,
    )


def build_evaluator(
    executor: EvalLoss,
    data: TokenData,
    source: str | None,
    max_batches: int | None,
    training: TrainingConfig,
    data_config: DataConfig,
    model: BDHConfig,
    tokenizer: Tokenizer,
    device: torch.device,
    dp: DistContext | None = None,
    record_activity: bool = True,
) -> Evaluator:
    """The evaluation recipe of `bdh-train train` and `bdh-train eval` alike: the run's block
    and batch sizes, summary trigger and head on `data` (of `source`, default the run's
    validation source), in bits per byte too when it is text of the run's tokenizer. Under
    torchrun (`dp`), data-parallel ranks split the batches and add their sums (pipeline ranks
    evaluate every batch together). With `record_activity` and `training.eval_activity` the same
    forwards record the neurons' activity (not under a multi-process pipeline, whose ranks hold
    some layers each)."""
    t, dp = training, dp or DistContext()
    records = record_activity and t.eval_activity
    recorded = executor if isinstance(executor, LanguageTrainModel) and records else None
    source = validation_source(data_config) if source is None else source
    return Evaluator(
        executor,
        data,
        t.block_size,
        t.batch_size,
        max_batches,
        device,
        data_config.summary_trigger(),
        model.language_head,
        text_tokenizer(tokenizer, source),
        part=(dp.rank, dp.world_size),
        add_across_ranks=partial(all_reduce_sums, group=dp.group) if dp.active else None,
        every=t.eval_every,
        last_step=t.max_steps,
        activity_of=None if recorded is None else recorded.model,
    )


def evaluation_data(
    data: DataConfig, source: str | None, vocab_size: int, block_size: int
) -> TokenData:
    """`source` (`bdh-train eval --data`), else the run's validation split."""
    if source:
        tokens = data.load_source(source, vocab_size)
        tokens.validate_for_block(block_size, "eval data")
        return tokens
    _, val = data.load_splits(vocab_size, block_size)
    if val is None:
        raise ConfigError(
            "the run has no validation split (data.val_fraction = 0); pass --data SOURCE"
        )
    return val


def evaluate_model(
    model: BDH,
    tokenizer: Tokenizer | None,
    training: TrainingConfig,
    data_config: DataConfig,
    source: str | None,
    max_batches: int | None,
) -> EvalResult:
    """`bdh-train eval`: the run's evaluation recipe (`build_evaluator`) on `source`, else
    the run's validation split, with the model where it is. A model without a tokenizer of
    its own reads bytes. Its row is the loss alone: `inspect` reports the activity."""
    t = training
    data = evaluation_data(data_config, source, model.config.vocab_size, t.block_size)
    step = LanguageTrainModel(model, tbptt_chunk_size=t.tbptt_chunk_size)
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    name = source or validation_source(data_config)
    device = model.embed.weight.device
    evaluator = build_evaluator(
        step,
        data,
        name,
        max_batches,
        t,
        data_config,
        model.config,
        tok,
        device,
        record_activity=False,
    )
    return evaluator.run()
