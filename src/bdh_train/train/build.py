"""The components of a training run built from their config sections: the model, the step
executor (one process, DDP, a pipeline replica or FSDP shards), the loader and the
evaluator. The trainer calls these and wires the results together."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import IO

import torch
from tqdm import tqdm

from bdh_train.data.config import DataConfig
from bdh_train.data.eval_windows import eval_window_count
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
from bdh_train.train.memory_check import check_step_memory, process_share
from bdh_train.train.profile import StepProfiler
from bdh_train.train.reduce import all_reduce_sums
from bdh_train.train.schedules import GradientScaleSchedule
from bdh_train.train.step import LanguageTrainModel, StepExecutor
from bdh_train.utils import steps_cap

Loader = RandomWindowLoader | StreamingDocumentLoader | StreamingCorpusLoader


def build_model(
    model: BDHConfig,
    training: TrainingConfig,
    device: torch.device,
    parallel: ParallelConfig | None = None,
    world_size: int = 1,
    optimizer: str = "adamw",
) -> BDH:
    """A freshly initialised model from the run's seed, with its recompute and compile
    settings. Refused before anything is allocated when one train step of this process (of
    `world_size` on the `parallel` mesh, with the optimizer named `optimizer`) would not fit
    in its memory (`check_step_memory`)."""
    check_compiler(training.compile, device)
    share = process_share(model, training, parallel or ParallelConfig(), world_size)
    check_step_memory(model, training, device, share, optimizer=optimizer)
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
        if t.bfloat16_autocast(device.type)
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


@dataclass
class EvalRecipe:
    """What a run's evaluations follow: its [training] (block and batch sizes, cadence,
    activity recording), its [data] (summary trigger, validation source), its model's head
    and its tokenizer (bits per byte for text of it)."""

    training: TrainingConfig
    data: DataConfig
    model: BDHConfig
    tokenizer: Tokenizer


def build_evaluator(
    executor: EvalLoss,
    data: TokenData,
    recipe: EvalRecipe,
    device: torch.device,
    max_batches: int | None = None,
    dp: DistContext | None = None,
    *,
    source: str | None = None,
    record_activity: bool = True,
) -> Evaluator:
    """The evaluation recipe of `bdh-train train` and `bdh-train eval` alike: the run's block
    and batch sizes, summary trigger and head on `data` (of `source`, default the run's
    validation source), at most `max_batches` batches (None: all; at most `steps_cap()` when
    the environment sets it, a smoke test's bound), in bits per byte too when it is text of
    the run's tokenizer. Under torchrun (`dp`), data-parallel ranks split the
    batches and add their sums (pipeline ranks evaluate every batch together). With
    `record_activity` and `training.eval_activity` the same forwards record the neurons'
    activity (not under a multi-process pipeline, whose ranks hold some layers each)."""
    t, dp = recipe.training, dp or DistContext()
    if (cap := steps_cap()) is not None:
        max_batches = cap if max_batches is None else min(max_batches, cap)
    records = record_activity and t.eval_activity
    recorded = executor if isinstance(executor, LanguageTrainModel) and records else None
    source = validation_source(recipe.data) if source is None else source
    return Evaluator(
        executor,
        data,
        t.block_size,
        t.batch_size,
        max_batches,
        device,
        recipe.data.summary_trigger(),
        recipe.model.language_head,
        text_tokenizer(recipe.tokenizer, source),
        part=(dp.rank, dp.world_size),
        add_across_ranks=partial(all_reduce_sums, group=dp.group) if dp.active else None,
        every=t.eval_every,
        last_step=t.max_steps,
        activity_of=None if recorded is None else recorded.model,
    )


def evaluate_model(
    model: BDH,
    tokenizer: Tokenizer | None,
    training: TrainingConfig,
    data_config: DataConfig,
    source: str | None,
    max_batches: int | None,
    report: IO[str] | None = None,
) -> EvalResult:
    """`bdh-train eval`: the run's evaluation recipe (`build_evaluator`) on
    `DataConfig.evaluation_data` (`source`, else the run's validation split), with the model
    where it is. A model without a tokenizer of
    its own reads bytes. With
    `report` (stderr), what is evaluated and how it relates to the figure `train` printed
    (`eval_scope`) is written there first, then a progress bar. Its row is the loss alone:
    `inspect` reports the activity."""
    t = training
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    data = data_config.evaluation_data(source, model.config.vocab_size, t.block_size, tok)
    step = LanguageTrainModel(model, tbptt_chunk_size=t.tbptt_chunk_size)
    name = source or validation_source(data_config)
    device = model.embed.weight.device
    recipe = EvalRecipe(t, data_config, model.config, tok)
    evaluator = build_evaluator(
        step, data, recipe, device, max_batches, source=name, record_activity=False
    )
    if report is None:
        return evaluator.run()
    report.write(eval_scope(evaluator, source, name, t.eval_steps) + "\n")
    bar = tqdm(total=evaluator.batch_count, file=report, unit="batch", leave=False, mininterval=1)
    with bar:
        evaluator.progress = bar.update
        return evaluator.run()


def eval_scope(evaluator: Evaluator, source: str | None, name: str, eval_steps: int) -> str:
    """What `bdh-train eval` evaluates, and how its figure relates to the one `train`
    printed: train evaluates `training.eval_steps` batches of windows sampled across its
    validation split (`sampled_windows`), the same ones in the same order, so `--batches
    eval_steps` on that split gives train's last figure (from the same weights, in float32);
    eval takes every batch unless --batches limits it. `source` is eval's --data (None: the
    run's validation split), `name` what the data is called."""
    e = evaluator
    windows = eval_window_count(len(e.data), e.block_size)
    total = -(-windows // e.batch_size)
    what = f"the run's validation split (of {name})" if source is None else e.data.source
    count = (
        f"all {total} batches" if e.batch_count == total else f"{e.batch_count} of {total} batches"
    )
    relation = (
        f"train's val_loss is over training.eval_steps = {eval_steps} batches sampled "
        "across the run's validation split"
    )
    if source is None:
        relation += f" (--batches {eval_steps} gives the figure train printed last)"
    return f"eval: {count} of {e.batch_size} x {e.block_size} tokens of {what}; {relation}"
