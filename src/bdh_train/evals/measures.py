"""`bdh-train eval --context-curve / --retention / --passkey / --recall`: the options, their
checks (all before the model is loaded or anything is allocated), the run of the measures on
a loaded model and the files they write: OUT/context_curve.{png,json}, OUT/retention.json,
OUT/passkey.{png,json}, OUT/recall.{png,json}. Every measure is computed before the first
file is written, so a refused or failed run writes nothing."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bdh_train.config import RunConfig
from bdh_train.data.tokenizer import Tokenizer
from bdh_train.data.tokens import TokenData
from bdh_train.errors import ConfigError
from bdh_train.evals import context as memory
from bdh_train.evals import passkey, recall
from bdh_train.evals.scoring import score_continuations, text_model
from bdh_train.model.bdh import BDH
from bdh_train.model.summary import SummaryEvents
from bdh_train.shared.loading import summary_events
from bdh_train.storage.output import check_output, write_file
from bdh_train.train.machine_memory import available_memory
from bdh_train.utils import steps_cap

CURVE_BLOCKS = 16
"""--length defaults to this many training blocks."""
PASSKEY_BLOCKS = (1, 2, 4, 8)
"""--passkey-lengths defaults to these multiples of the training block."""
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
RECALL_LENGTHS = (1, 2, 4)
"""--recall-lengths defaults to these multiples of data.mqar.length."""
RECALL_PAIRS = (4, 2, 1)
"""--recall-pairs defaults to data.mqar.pairs divided by these (at least 1 pair)."""


@dataclass
class MemoryEvals:
    """Which measures to run and their sizes (None: the default derived from the run)."""

    context_curve: bool = False
    retention: bool = False
    passkey: bool = False
    length: int | None = None
    """Context curve: tokens per sequence (default CURVE_BLOCKS training blocks)."""
    sequences: int = 4
    chunks: int = 8
    """Retention: chunks of one training block each."""
    passkey_lengths: list[int] | None = None
    passkey_depths: list[float] | None = None
    """Needle depths (default PASSKEY_DEPTHS)."""
    passkey_trials: int = 4
    recall: bool = False
    recall_pairs: list[int] | None = None
    """Pairs per example (default: data.mqar.pairs over RECALL_PAIRS)."""
    recall_lengths: list[int] | None = None
    """Tokens per example (default: data.mqar.length times RECALL_LENGTHS)."""
    recall_examples: int = 32
    out: Path = Path(".")
    """Where the files go; `bdh-train eval` passes --out, else `storage.places.results_dir`'s
    folder for the model (evals/<run>)."""
    force: bool = False
    """Replace result files an earlier run left in `out` (only regular files)."""

    def files(self) -> list[Path]:
        """The files the measures write under `out`."""
        names = []
        if self.context_curve:
            names += ["context_curve.json", "context_curve.png"]
        if self.retention:
            names += ["retention.json"]
        if self.passkey:
            names += ["passkey.json", "passkey.png"]
        if self.recall:
            names += ["recall.json", "recall.png"]
        return [self.out / name for name in names]

    @property
    def reads_data(self) -> bool:
        """Whether a measure reads evaluation data (the passkey makes its own text)."""
        return self.context_curve or self.retention

    @property
    def depths(self) -> list[float]:
        return list(PASSKEY_DEPTHS) if self.passkey_depths is None else self.passkey_depths

    def capped(self, cap: int | None) -> MemoryEvals:
        """These options with at most `cap` context-curve sequences, passkey trials per cell
        and recall examples per cell (`steps_cap`: a smoke test's bound); unchanged for
        None."""
        if cap is None:
            return self
        return replace(
            self,
            sequences=min(self.sequences, cap),
            passkey_trials=min(self.passkey_trials, cap),
            recall_examples=min(self.recall_examples, cap),
        )

    def check(self) -> None:
        """ConfigError for a size that is not positive or a depth outside [0, 1]."""
        sizes = {
            "--length": self.length,
            "--sequences": self.sequences,
            "--chunks": self.chunks,
            "--passkey-trials": self.passkey_trials,
            "--recall-examples": self.recall_examples,
        }
        for name, value in sizes.items():
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value}")
        if self.chunks < 2:
            raise ConfigError("--chunks must be at least 2 (chunk 0 is only context), got 1")
        if self.passkey_lengths is not None and min(self.passkey_lengths, default=0) < 1:
            raise ConfigError(f"--passkey-lengths must be positive, got {self.passkey_lengths}")
        for name, values in (
            ("--recall-pairs", self.recall_pairs),
            ("--recall-lengths", self.recall_lengths),
        ):
            if values is not None and min(values, default=0) < 1:
                raise ConfigError(f"{name} must be positive integers, got {values}")
        if not self.depths or not all(0.0 <= d <= 1.0 for d in self.depths):
            raise ConfigError(f"--passkey-depths must lie in [0, 1], got {self.depths}")
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out} exists and is not a directory")
        for path in self.files():  # the output policy, before anything is computed
            check_output(path, "--out file", force=self.force)


def run_memory_evals(
    model: BDH,
    tokenizer: Tokenizer | None,
    cfg: RunConfig,
    source: str | None,
    options: MemoryEvals,
) -> list[str]:
    """Run the measures `options` asks for on `model` (a token-head model whose text
    `tokenizer` is; --recall alone needs none), on `source` (else the run's validation
    split); write their files under options.out and return their tables and the paths
    written, to print. Under `steps_cap` every measure reads at most that many sequences
    (trials, examples) per cell."""
    options = options.capped(steps_cap())
    text = None
    if options.passkey or options.reads_data:
        text = text_model(model, tokenizer, "the model")
    elif model.config.language_head.type != "token":  # recall reads ids: logits suffice
        raise ConfigError(
            f"--recall needs a model with token logits (model.language_head.type = 'token'), "
            f"got {model.config.language_head.type!r}"
        )
    block = cfg.training.block_size
    batch = cfg.training.batch_size
    events = summary_events(model, cfg)
    lengths = options.passkey_lengths or [block * m for m in PASSKEY_BLOCKS]
    if options.passkey:
        room = available_memory(torch.device("cpu"))
        passkey.check_fits(lengths, options.passkey_trials, room.bytes, room.source)
    mqar = cfg.data.mqar
    vocab = _recall_vocab(model, cfg)
    recall_pairs = options.recall_pairs or sorted({max(1, mqar.pairs // d) for d in RECALL_PAIRS})
    recall_lengths = options.recall_lengths or [mqar.length * m for m in RECALL_LENGTHS]
    if options.recall:
        if vocab > model.config.vocab_size:
            raise ConfigError(
                f"data.mqar.vocab_size ({vocab}) is more than the model's vocabulary "
                f"({model.config.vocab_size})"
            )
        recall.check_cells(recall_pairs, recall_lengths, vocab)
        room = available_memory(torch.device("cpu"))
        passkey.check_fits(
            recall_lengths,
            options.recall_examples,
            room.bytes,
            room.source,
            ("--recall-lengths", "--recall-examples"),
        )
    tokens = None
    if options.reads_data:
        tokens = cfg.data.evaluation_data(source, model.config.vocab_size, block).tokens
    files: dict[str, object] = {}
    lines: list[str] = []
    if options.context_curve:
        assert tokens is not None
        length = options.length or CURVE_BLOCKS * block
        curve = memory.context_curve(model, tokens, block, length, options.sequences, batch, events)
        files["context_curve"] = curve
        lines.append(curve.table())
    if options.retention:
        assert tokens is not None
        kept = memory.retention(model, tokens, block, options.chunks, batch, events)
        files["retention"] = kept
        lines.append(kept.table())
    if options.passkey:

        def scorer(pairs):
            return score_continuations(model, pairs, batch, events)

        assert text is not None
        grid = passkey.passkey_grid(scorer, text, lengths, options.depths, options.passkey_trials)
        files["passkey"] = grid
        lines.append(grid.table())
    if options.recall:
        examples = options.recall_examples
        found = _recall_grid(model, cfg, events, recall_pairs, recall_lengths, examples)
        files["recall"] = found
        lines.append(found.table())
    lines.extend(f"wrote {path}" for path in _write(files, options.out, options.force))
    return lines


def _recall_vocab(model: BDH, cfg: RunConfig) -> int:
    """The ids MQAR examples are drawn from: data.mqar.vocab_size, else the model's."""
    mqar = cfg.data.mqar
    return model.config.vocab_size if mqar.vocab_size is None else mqar.vocab_size


def _recall_grid(
    model: BDH,
    cfg: RunConfig,
    events: SummaryEvents | None,
    pairs: list[int],
    lengths: list[int],
    examples: int,
) -> recall.RecallGrid:
    """The model's recall grid on fresh MQAR examples of the run's generator settings (not
    its training examples: seed data.mqar.seed + 1), the trained length marked when the run
    trained on MQAR."""
    mqar = cfg.data.mqar
    return recall.recall_grid(
        recall.model_scorer(model, cfg.training.batch_size, events),
        pairs,
        lengths,
        _recall_vocab(model, cfg),
        examples,
        mqar.seed + 1,
        mqar.power_a,
        mqar.length if cfg.data.source == "mqar" else None,
        mqar.random_fill,
    )


RUN_END_RECALL_EXAMPLES = 64
"""Examples per length of the recall line that ends a run trained on MQAR."""


def run_end_line(model: BDH, val: TokenData | None, cfg: RunConfig) -> str | None:
    """The line that ends `bdh-train train` on what the model's state does: for a run on
    MQAR (data.source = "mqar") the recall of its trained number of pairs at RECALL_LENGTHS
    (1, 2, 4) times the trained length, the state carried; for any other run the state
    gain on its validation split (`context.state_gain_line`). The validation split of MQAR is
    independent examples back to back, which a context curve would read as one text. Read
    in eval mode, the model's mode restored after; None for a model without a token head."""
    if model.config.language_head.type != "token":
        return None
    events = summary_events(model, cfg)
    training_mode = model.training
    model.eval()
    try:
        if cfg.data.source != "mqar":
            return memory.state_gain_line(model, val, cfg.training, events)
        mqar, cap = cfg.data.mqar, steps_cap()
        lengths = [mqar.length * m for m in RECALL_LENGTHS]
        examples = RUN_END_RECALL_EXAMPLES if cap is None else min(cap, RUN_END_RECALL_EXAMPLES)
        return _recall_grid(model, cfg, events, [mqar.pairs], lengths, examples).run_end_line()
    finally:
        model.train(training_mode)


def _write(results: dict[str, object], out: Path, force: bool = False) -> list[Path]:
    """Each result's JSON (and plot, for the curve and the passkey grid) under `out`, by the
    output policy (`storage.output`), every file checked before the folder is made."""
    for name in results:
        check_output(out / f"{name}.json", "--out file", force=force)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, result in results.items():
        text = json.dumps(asdict(result), indent=1)  # type: ignore[call-overload]
        written.append(write_file(out / f"{name}.json", text.encode(), "--out file", force=force))
        plot = out / f"{name}.png"
        if isinstance(result, memory.ContextCurve):
            check_output(plot, "--out file", force=force)
            written.append(memory.plot_context_curve(result, plot))
        elif isinstance(result, passkey.PasskeyGrid):
            check_output(plot, "--out file", force=force)
            written.append(passkey.plot_passkey(result, plot))
        elif isinstance(result, recall.RecallGrid):
            check_output(plot, "--out file", force=force)
            written.append(recall.plot_recall(result, plot))
    return written
