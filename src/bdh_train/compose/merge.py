"""`bdh-train merge`: sources joined side by side (`model/surgery.py`), optionally fine-tuned
through training's own step executor, window and optimizer set-up (a warm-up, chosen
parameter groups frozen, windows mixed row by row from the sources' data), each source
domain's loss measured before and after, and the result written as a checkpoint directory."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from bdh_train.compose.common import (
    FINETUNE_WARMUP_STEPS,
    Source,
    check_out,
    load_source,
    source_tokenizer_text,
    write_composed,
)
from bdh_train.data.events import SummaryEventTrigger
from bdh_train.data.loaders import MixedWindowLoader
from bdh_train.data.tokens import TokenData
from bdh_train.distributed.config import ParallelConfig
from bdh_train.distributed.env import DistContext
from bdh_train.errors import ConfigError
from bdh_train.model import BDH, groups
from bdh_train.model.surgery import merge_weights, merged_config
from bdh_train.train.accumulate import WeightedGradientAccumulator
from bdh_train.train.build import build_executor, evaluate_model
from bdh_train.train.config import TrainingConfig
from bdh_train.train.console import Progress, format_duration
from bdh_train.train.optim import OptimizerConfig
from bdh_train.train.schedules import GradientScaleSchedule
from bdh_train.train.state import TrainerState
from bdh_train.train.window import StepWindow, reduction_for
from bdh_train.utils import steps_cap


# ---------------------------------------------------------------- merge
@dataclass
class MergeReport:
    """Each source domain's validation loss (and bits per byte) for each model: the sources,
    the merge and, after a fine-tune, the fine-tuned merge."""

    names: list[str]
    """The sources' short names (A, B, ...), which also name their domains."""
    paths: list[str]
    results: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """model name -> domain name -> EvalResult.row()."""
    finetune_losses: list[float] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        """metrics.jsonl rows: one per fine-tune step, then one per (model, domain)."""
        out: list[dict[str, Any]] = [
            {"step": step, "loss": loss} for step, loss in enumerate(self.finetune_losses, 1)
        ]
        for model, domains in self.results.items():
            for domain, row in domains.items():
                out.append({"model": model, "domain": domain, **row})
        return out

    def table(self) -> str:
        """The report as text: a row per model, a column per domain (bits per byte where the
        domain is text, else the loss in nats)."""
        sources = [f"{n} = {p}" for n, p in zip(self.names, self.paths, strict=True)]
        header = ["model", *(f"domain {n}" for n in self.names)]
        lines = ["  ".join(f"{h:>14}" for h in header)]
        for model, domains in self.results.items():
            cells = [f"{model:>14}"]
            for name in self.names:
                row = domains[name]
                value = row.get("bits_per_byte", row["val_loss"])
                unit = "bpb" if "bits_per_byte" in row else "nats"
                cells.append(f"{value:>9.4f} {unit:<4}")
            lines.append("  ".join(cells))
        return "\n".join(["sources: " + "; ".join(sources), *lines])


@dataclass
class FinetuneConfig:
    """The optional short fine-tune of a merge."""

    steps: int = 0
    """Optimizer steps (0: none)."""
    data: list[str] = field(default_factory=list)
    """Sources to fine-tune on (mixed row by row); empty: the sources' training splits."""
    freeze: list[str] = field(default_factory=list)
    """Parameter groups (model.groups.TARGETS) that get no gradient and no weight decay."""
    seed: int = 0

    def validate(self) -> FinetuneConfig:
        if self.steps < 0:
            raise ConfigError(f"--finetune-steps must be >= 0, got {self.steps}")
        for target in self.freeze:
            if target not in groups.TARGETS:
                raise ConfigError(
                    f"--freeze names an unknown parameter group {target!r}; expected some of "
                    f"{', '.join(groups.TARGETS)}"
                )
        if self.data and not self.steps:
            raise ConfigError("--data is the fine-tune's data: pass --finetune-steps K too")
        return self


def _check_tokenizers(sources: list[Source], names: list[str]) -> None:
    first = source_tokenizer_text(sources[0])
    for source, name in zip(sources[1:], names[1:], strict=True):
        if source_tokenizer_text(source) != first:
            raise ConfigError(
                f"cannot merge {name} ({source.path}) with A ({sources[0].path}): their "
                "tokenizers differ; merge only models trained with the same tokenizer"
            )


class MergeProgress:
    """What merge prints while it works, on `stream` (stderr: the table goes to stdout): a
    line per evaluation with how many of `evaluations` are done and the ETA of the rest (from
    the evaluations' own time), and the fine-tune's loss lines or bar with their ETA
    (`finetune`: train's `Progress`). None prints nothing."""

    def __init__(
        self, stream: IO[str] | None, evaluations: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stream, self.total, self.clock = stream, evaluations, clock
        self.done, self.spent = 0, 0.0

    def evaluate(
        self, model: BDH, label: str, sources: list[Source], names: list[str], batches: int | None
    ) -> dict[str, dict[str, float]]:
        """`model` (called `label`) on each source's validation split, with that run's recipe."""
        out = {}
        for source, name in zip(sources, names, strict=True):
            cfg, started = source.cfg, self.clock()
            result = evaluate_model(model, source.tokenizer, cfg.training, cfg.data, None, batches)
            out[name] = result.row()
            self.done += 1
            self.spent += self.clock() - started
            eta = self.spent / self.done * (self.total - self.done)
            self._print(
                f"evaluated {label} on domain {name}: val_loss {result.val_loss:.4f} "
                f"({self.done}/{self.total} evaluations, ETA {format_duration(eta)})"
            )
        return out

    def finetune(self, steps: int, log_every: int) -> Progress:
        return Progress(steps, 0, self.stream, self.stream is not None, log_every, clock=self.clock)

    def _print(self, line: str) -> None:
        if self.stream is not None:
            print(line, file=self.stream, flush=True)


def merge_runs(
    paths: list[str],
    out: str | Path,
    embeddings: str = "average",
    finetune: FinetuneConfig | None = None,
    eval_batches: int | None = 20,
    progress: IO[str] | None = None,
) -> MergeReport:
    """Merge the sources' models along N (`merge_weights`), report each source domain's loss
    for every source, the merge and the fine-tuned merge, and write the merge (fine-tuned
    when asked) as the checkpoint directory `out` with the report in its metrics.jsonl.
    `progress` (stderr) gets each evaluation and fine-tune step as it is done
    (`MergeProgress`)."""
    finetune = (finetune or FinetuneConfig()).validate()
    cap = steps_cap()
    if cap is not None and finetune.steps > cap:
        finetune = dataclasses.replace(finetune, steps=cap)
    if len(paths) < 2:
        raise ConfigError(f"merge needs at least two sources, got {len(paths)}")
    if len(paths) > 26:
        raise ConfigError(f"merge takes at most 26 sources (named A-Z), got {len(paths)}")
    out = check_out(out)
    names = [chr(ord("A") + i) for i in range(len(paths))]
    sources = [load_source(p) for p in paths]
    config = merged_config(
        [s.model.config for s in sources],
        [f"{n} ({s.path})" for n, s in zip(names, sources, strict=True)],
    )
    _check_tokenizers(sources, names)
    weights = merge_weights(
        [s.model.state_dict() for s in sources], [s.model.config for s in sources], embeddings
    )
    merged = BDH(config).to(sources[0].model.embed.weight.dtype)
    merged.load_state_dict(weights)
    merged.eval()
    # the fine-tune's data is read (and refused) before the sources' evaluations take time
    data = (
        _finetune_data(sources, finetune.data, merged.config.vocab_size) if finetune.steps else []
    )
    report = MergeReport(names, [s.path for s in sources])
    models = len(sources) + 1 + (1 if finetune.steps else 0)
    shown = MergeProgress(progress, models * len(sources))
    for source, name in zip(sources, names, strict=True):
        report.results[name] = shown.evaluate(source.model, name, sources, names, eval_batches)
    report.results["merged"] = shown.evaluate(merged, "merged", sources, names, eval_batches)
    if finetune.steps:
        first = sources[0].cfg
        report.finetune_losses = finetune_model(
            merged,
            data,
            finetune,
            merge_finetune_recipe(first.optimizer),
            first.training,
            shown.finetune(finetune.steps, first.training.log_every),
            first.data.summary_trigger(),
        )
        label = f"merged+ft{finetune.steps}"
        report.results[label] = shown.evaluate(merged, label, sources, names, eval_batches)
    write_composed(out, merged, sources[0], report.rows())
    return report


def _finetune_data(sources: list[Source], named: list[str], vocab_size: int) -> list[TokenData]:
    """The fine-tune's domains: the named sources read as the first run reads data, else
    every source run's training split."""
    if named:
        data = sources[0].cfg.data
        return [data.load_source(name, vocab_size) for name in named]
    return [s.cfg.data.load_splits(vocab_size, s.cfg.training.block_size)[0] for s in sources]


def merge_finetune_recipe(optimizer: OptimizerConfig) -> OptimizerConfig:
    """The optimizer of merge's own fine-tune (--finetune-steps): the first source's (its lr,
    betas, weight decay, clipping; AdamW or Muon) with its lr held constant after a linear
    warm-up of FINETUNE_WARMUP_STEPS (the fresh optimizer's moments are empty: without a
    warm-up its first updates are its largest, and the loss rose at the second step). Not
    `finetune_recipe`'s decayed rate, which a run that trains on a composed model starts
    with: a merge starts far from either source's fit (its dense parts are averages), and at
    equal steps the source's rate repairs more."""
    return dataclasses.replace(
        optimizer, schedule="constant", warmup_steps=FINETUNE_WARMUP_STEPS, min_lr=0.0
    )


def finetune_model(
    model: BDH,
    domains: list[TokenData],
    finetune: FinetuneConfig,
    optimizer: OptimizerConfig,
    training: TrainingConfig,
    progress: Progress | None = None,
    summary_trigger: SummaryEventTrigger | None = None,
) -> list[float]:
    """`finetune.steps` optimizer steps of `optimizer` (its warm-up and schedule over those
    steps) through training's step executor and window (`build_executor`, `StepWindow`),
    each on `training.batch_size` rows of `training.block_size` tokens mixed row by row
    from `domains` (`MixedWindowLoader`); returns each step's loss, each step shown on
    `progress` as train shows its steps. A step with a non-finite loss or gradient is skipped
    as in training. The state is not carried from one batch to the next (the windows are
    unrelated). Parameters of the frozen groups have requires_grad False for the fine-tune,
    so they get no gradient, and are left out of the optimizer, so its decoupled weight decay
    never touches them."""
    t = dataclasses.replace(
        training,
        max_steps=finetune.steps,
        tbptt_persist_across_steps=False,
        min_logical_block_size=0,
        stream_documents="fixed",
    )
    for data in domains:
        data.validate_for_block(t.block_size, "fine-tune data")
    frozen = {
        name for target in finetune.freeze for name in groups.params_for_target(model, target)
    }
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    torch.manual_seed(finetune.seed)
    device, scales, state = model.embed.weight.device, GradientScaleSchedule(model), TrainerState()
    executor, dp = build_executor(model, t, ParallelConfig(), DistContext(), device, scales, None)
    accumulator = WeightedGradientAccumulator(model, torch.float32)
    window = StepWindow(
        model,
        reduction_for(executor, accumulator, model, dp),
        optimizer.build(model),
        scales,
        state,
        optimizer,
        t,
        log=(lambda line: None) if progress is None else progress.log,
        last_good=lambda: "nothing was written: use fewer --finetune-steps or freeze more groups",
    )
    loader = MixedWindowLoader(domains, t.block_size, t.batch_size, finetune.seed, summary_trigger)
    losses = []
    try:
        while state.step < finetune.steps:
            window.micro_step(lambda: loader.next_batch().to(device))
            row = window.optimizer_step()
            losses.append(row["loss"])
            if progress is not None:
                progress.update(state.step, row)
    finally:
        if progress is not None:
            progress.close()
        model.eval()
        for param in model.parameters():
            param.requires_grad_(True)
    return losses
