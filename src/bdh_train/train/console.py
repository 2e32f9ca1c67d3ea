"""What a run prints: the banner before it starts, a progress bar or plain loss lines while it
trains, the evaluation and stop lines, and the summary with the commands that use it."""

from __future__ import annotations

import math
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tqdm import tqdm

from bdh_train.data.config import DataConfig
from bdh_train.data.tokenizer import HFTokenizer, Tokenizer
from bdh_train.data.tokens import TokenData
from bdh_train.train.config import TrainingConfig
from bdh_train.train.evaluate import Evaluator
from bdh_train.train.state import TrainerState

if TYPE_CHECKING:
    import torch


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """A tqdm bar on a terminal, with the loss lines written above it (`tqdm.write`) so they
    stay visible; plain lines otherwise (no bar spam in logs). A loss line is printed for the
    first step of a session, every `log_every` steps, the last step, and, on a pipe, at least
    every `heartbeat_s` seconds; each says step/total, tokens seen, tok/s and the ETA.

    A console that goes away (the reader of a pipe died, as `tee` does on Ctrl-C) never stops
    the run: from then on nothing is printed, and the lines logged with `keep` (where a stop
    left its checkpoint) go to `fallback` (the run's error log) instead."""

    def __init__(
        self,
        total: int,
        initial: int,
        stream: IO[str] | None = None,
        enabled: bool = True,
        log_every: int = 0,
        initial_tokens: int = 0,
        heartbeat_s: float = 30.0,
        clock: Any = time.perf_counter,
        fallback: Callable[[str], None] | None = None,
    ):
        self.stream = stream or sys.stdout
        self.fallback, self.lost = fallback, False
        self.enabled = enabled
        self.total, self.initial, self.initial_tokens = total, initial, initial_tokens
        self.log_every, self.heartbeat_s, self.clock = log_every, heartbeat_s, clock
        self.started = self.last_line = clock()
        self.mfu: Callable[[float], float] | None = None
        """The MFU of a tokens-per-second rate (`Throughput.mfu`), printed after it."""
        self.bar = None
        if enabled and self.stream.isatty():
            self.bar = tqdm(
                total=total, initial=initial, file=self.stream, unit="step", dynamic_ncols=True
            )

    def restart_clock(self) -> None:
        """Time tok/s and the ETA from now (the start of the first step)."""
        self.started = self.last_line = self.clock()

    def _due(self, step: int, now: float) -> bool:
        if step == self.initial + 1 or step == self.total:
            return True
        if self.log_every and step % self.log_every == 0:
            return True
        return self.bar is None and now - self.last_line >= self.heartbeat_s

    def line(self, row: dict[str, Any], now: float) -> str:
        """One loss line: step/total, loss, lr, gradient norm, tokens seen, tok/s, MFU (when
        the run's FLOPs were counted), ETA."""
        step, done = row["step"], row["step"] - self.initial
        spent = max(now - self.started, 1e-9)
        rate = (row["tokens"] - self.initial_tokens) / spent
        eta = (self.total - step) * spent / max(done, 1)
        width = len(str(self.total))
        mfu = f"MFU {100 * self.mfu(rate):.1f}% | " if self.mfu is not None else ""
        return (
            f"step {step:>{width}}/{self.total} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"grad_norm {row['grad_norm']:.3f} | {row['tokens']:,} tok | {rate:,.0f} tok/s | "
            f"{mfu}ETA {format_duration(eta)}"
        )

    def update(self, step: int, row: dict[str, Any] | None) -> None:
        """Advance to `step`; `row` is that optimizer step's metrics (step, tokens, loss, lr,
        grad_norm), printed as a loss line when one is due."""
        if not self.enabled:
            return
        now = self.clock()
        bar = self.bar
        if bar is not None:
            self._write(lambda: bar.update(step - bar.n))
            if row is not None:
                self._write(lambda: bar.set_postfix(loss=f"{row['loss']:.4f}"))
        if row is not None and self._due(step, now):
            self.log(self.line(row, now))
            self.last_line = now

    def log(self, message: str, keep: bool = False) -> None:
        """Print one line; with `keep`, a line that must outlive a lost console."""
        if not self.enabled:
            return
        bar = self.bar
        if bar is not None:
            self._write(lambda: bar.write(message, file=self.stream))
        else:
            self._write(lambda: print(message, file=self.stream, flush=True))
        if self.lost and keep and self.fallback is not None:
            self.fallback(message)

    def close(self) -> None:
        bar, self.bar = self.bar, None
        if bar is not None:
            self._write(bar.close)

    def stop(self, message: str) -> None:
        """Close the bar, then print `message` (kept, as `log(keep=True)`) as the last line:
        logged before the close, tqdm would draw the bar again below it."""
        self.close()
        self.log(message, keep=True)

    def _write(self, write: Callable[[], object]) -> None:
        """`write` to the console unless it is lost; an OSError from it (a closed pipe, a
        closed terminal) marks it lost."""
        if self.lost:
            return
        try:
            write()
        except OSError:
            self.lost = True


def device_line(
    device: torch.device,
    world_size: int,
    mesh: tuple[int, int],
    sharded: bool,
    training: TrainingConfig,
) -> str:
    """The device, under torchrun the process count, mesh and sharding, and what training's
    products run in (`TrainingConfig.precision`)."""
    line = str(device)
    if world_size > 1:
        replicas, stages = mesh
        line += f" x {world_size} processes"
        if stages > 1:
            line += f" ({replicas} data-parallel x {stages} pipeline stages)"
        if sharded:
            line += " (FSDP: parameters, gradients and optimizer state sharded)"
    return f"{line}, {training.precision(device.type)}"


@dataclass
class RunData:
    """The banner's data: the source, each split's size, the tokenizer and what each
    evaluation reads."""

    source: str
    train_tokens: int
    val_tokens: int | None
    tokenizer: str | None = None
    """The Hugging Face tokenizer as named, with its size; None for bytes."""
    evaluation: tuple[int, int, int] | None = None
    """(batches, tokens, every): what each evaluation reads (`Evaluator.coverage`) and how
    often; None without a validation split."""

    @classmethod
    def of(
        cls,
        data: DataConfig,
        tokenizer: Tokenizer,
        splits: tuple[TokenData, TokenData | None],
        evaluator: Evaluator | None,
    ) -> RunData:
        """A run's data as its [data] section, tokenizer, splits and evaluator have it."""
        train, val = splits
        hf = isinstance(tokenizer, HFTokenizer)
        return cls(
            data.source,
            len(train),
            None if val is None else len(val),
            f"{data.tokenizer} ({tokenizer.vocab_size:,} ids)" if hf else None,
            None if evaluator is None else (*evaluator.coverage, evaluator.every),
        )


@dataclass
class RunStart:
    """Where the run starts from: its weights and config, or the checkpoint it resumes."""

    saved_config: str
    """The run's saved config file (a resume's source)."""
    resumed_at: int | None = None
    """The checkpoint's step on a resume."""
    layered_on: str | None = None
    """The preset the config was layered on (`RunConfig.layered_on`)."""
    init_from: str | None = None
    """The weights a fresh run starts from (checkpoint.init_from); None when initialised."""


@dataclass
class Banner:
    """What the run is about to do."""

    run_dir: Path
    device: str
    """The device, under torchrun the processes, and the precision (`device_line`)."""
    parameters: int
    training: TrainingConfig
    """The run's [training]: its batch, block, accumulation, length and recurrence."""
    data: RunData
    start: RunStart
    threads: str | None = None
    """torch's CPU thread count and why (`ThreadChoice.describe`); None off the CPU."""
    throughput: str | None = None
    """FLOPs per token and the peak (`Throughput.describe`); None when not counted."""

    def lines(self) -> list[str]:
        t, params, accum = self.training, self.parameters, self.training.accumulation_steps
        data, start = self.data, self.start
        val = "no val split" if data.val_tokens is None else f"{data.val_tokens:,} val tokens"
        per_step = t.tokens_per_step
        micro = f" x {accum} micro-steps" if accum > 1 else ""
        if start.resumed_at is not None:
            steps = f"steps {start.resumed_at} -> {t.max_steps} (resumed)"
        else:
            steps = f"{t.max_steps:,} steps"
        tokenizer = [f"tokenizer      {data.tokenizer}"] if data.tokenizer is not None else []
        if start.layered_on is not None:
            layered = f"layered on {start.layered_on}"
        elif start.resumed_at is not None:
            layered = f"the run's saved {start.saved_config}"
        else:
            layered = "built directly (no preset)"
        threads = [f"threads        {self.threads}"] if self.threads is not None else []
        recurrence = [f"recurrence     {r}"] if (r := t.recurrence()) is not None else []
        init = [f"weights        loaded from {start.init_from}"] if start.init_from else []
        flops = [f"throughput     {self.throughput}"] if self.throughput is not None else []
        return [
            f"run directory  {self.run_dir.resolve()}",
            f"device         {self.device}",
            *threads,
            f"model          {params / 1e6:.2f} M parameters ({params:,})",
            *init,
            f"data           {data.source}: {data.train_tokens:,} train tokens, {val}",
            *self._evaluation(),
            *tokenizer,
            f"per step       {t.batch_size} x {t.block_size} tokens{micro} = {per_step:,} tokens",
            *recurrence,
            f"length         {steps} ({t.max_steps * per_step:,} tokens in all)",
            *flops,
            f"config         {layered}",
        ]

    def _evaluation(self) -> list[str]:
        split = self.data.val_tokens
        if self.data.evaluation is None or split is None:
            return []
        batches, tokens, every = self.data.evaluation
        block = self.training.block_size
        where = (  # the split's windows of block_size targets (after its first token)
            "the whole split"
            if tokens >= (split - 1) // block * block
            else f"{tokens / (split - 1):.1%} of the split, sampled across it"
        )
        when = f"every {every:,} steps and at the end" if every else "never (eval_every = 0)"
        return [
            f"validation     {batches} batch{'es' if batches != 1 else ''}, {tokens:,} tokens "
            f"({where}), {when}",
        ]


def command_name() -> str:
    """How to run bdh-train here: `bdh-train` when that is on PATH, else the interpreter
    running this with `-m bdh_train` (`python -m bdh_train` when `python` on PATH is it)."""
    if shutil.which("bdh-train"):
        return "bdh-train"
    python = shutil.which("python")
    same = python is not None and Path(python).resolve() == Path(sys.executable).resolve()
    return f"{'python' if same else shlex.quote(sys.executable)} -m bdh_train"


def summary_lines(
    run_dir: Path,
    state: TrainerState,
    val_loss: float | None,
    checkpoint: Path | None,
    loss_plot: Path,
    max_steps: int,
    writes_text: bool,
) -> list[str]:
    """Where the run's results are and the commands that use them (a run that ended before
    its `max_steps`, under a smoke test's cap, trains on to it with a plain --resume)."""
    steps, tokens, elapsed = state.step, state.tokens, state.elapsed
    quoted = shlex.quote(str(run_dir.resolve()))
    rate = tokens / max(elapsed, 1e-9)
    val = f"; val_loss {val_loss:.4f}" if val_loss is not None else ""
    lines = [
        f"finished {steps} steps, {tokens:,} tokens in {format_duration(elapsed)} "
        f"({rate:,.0f} tok/s){val}",
    ]
    if checkpoint is not None:
        lines.append(f"checkpoint     {checkpoint.resolve()}")
    if loss_plot.is_file():
        lines.append(f"loss plot      {loss_plot.resolve()}")
    command = command_name()
    longer = f" --set training.max_steps={2 * max_steps}" if steps >= max_steps else ""
    lines.append(f"train on       {command} train --resume {quoted}{longer}")
    if writes_text:
        lines.append(f"generate       {command} generate --checkpoint {quoted} --prompt 'The '")
    lines.append(f"evaluate       {command} eval --checkpoint {quoted}")
    return lines


def eval_line(step: int, val_loss: float, bits_per_byte: float | None) -> str:
    """An evaluation's line: the mean loss per token, and for text the same loss per UTF-8
    byte of that text in nats and in bits (a byte-level run's nats/byte is its val_loss; for
    ASCII text such as Shakespeare a byte is a character)."""
    per_byte = (
        f" | {bits_per_byte * math.log(2):.4f} nats/byte = {bits_per_byte:.3f} bits/byte"
        if bits_per_byte is not None
        else ""
    )
    return f"step {step:>6} | val_loss {val_loss:.4f}{per_byte}"


def budget_line(max_time: float | str, elapsed: float) -> str:
    """Why a run stopped on its time budget (training.max_time, as written)."""
    return (
        f"time budget spent: {format_duration(elapsed)} of training.max_time = {max_time!r} "
        "trained; raise it (or set 0) to train on"
    )


def stop_line(step: int, micro: int, checkpoint: Path, run_dir: Path) -> str:
    return (
        f"stopped at step {step} (+{micro} micro-steps); checkpoint {checkpoint}; continue "
        f"with: {command_name()} train --resume {run_dir}"
    )


def sample_lines(prompt: str, samples: list[tuple[float, str]]) -> str:
    """The end-of-run samples: each (temperature, continuation) of the one prompt."""
    heads = [f"(prompt: {prompt!r})"] + ["(the same prompt)"] * (len(samples) - 1)
    parts = [
        f"--- sample at temperature {t:g} {head} ---\n{text}"
        for head, (t, text) in zip(heads, samples, strict=True)
    ]
    return "\n".join([*parts, "---"])


class CompileNotice:
    """The line before a compiled run's first step (which compiles) and its time after."""

    def __init__(self, mode: str, steps_left: bool, log: Any) -> None:
        self.pending = mode != "off" and steps_left
        self.log = log
        if self.pending:
            log(f"compiling the model (training.compile = {mode!r}): the first step takes longer…")
        self.started = time.perf_counter()

    def step_done(self) -> None:
        if self.pending:
            self.pending = False
            self.log(f"compiled: the first step took {time.perf_counter() - self.started:.1f} s")


def resume_lines(
    checkpoint: Path,
    step: int,
    micro: int,
    accumulation_steps: int,
    notes: list[str],
    torn_metrics: Path | None,
) -> list[str]:
    """Where a resumed run continues from, the resume's warnings, and a notice when the
    metrics log's torn last line was dropped."""
    lines = [
        f"resumed from {checkpoint} at step {step} (micro-step {micro} of {accumulation_steps})",
        *notes,
    ]
    if torn_metrics is not None:
        lines.append(
            f"notice: the last line of {torn_metrics} was torn (an interrupted write) and was "
            "dropped"
        )
    return lines
