"""BDH with a preset's recipe against a GPT baseline of equal parameter count, at equal
wall-clock: which reaches the lower held-out loss in the same seconds of training.

Both train on the same bytes (tokenizer: bytes; the first 90% of `--data`) in the same token
order (the same seeded window starts, block and batch), each with its recipe's learning rate,
warm-up, betas, weight decay, clipping, dropout and precision (`training.dtype`: BDH's forward
passes under bfloat16 autocast where the trainer would take it on this CPU, the GPT's where the
config says 'bfloat16': its 'auto' is float32, its faster precision on a CPU with AMX too); the
cosine runs over the budget's seconds (progress = seconds trained / budget), not over a step
count nobody knows beforehand. The arms train in one process, one optimizer step each in turn,
and each counts only its own steps' seconds (after one untimed forward and backward, which takes
each arm's start-up off its clock), so machine load falls on all of them alike. When an arm has
spent its budget it stops; then every arm is scored on the same held-out text (the last 10%; its
first `--eval-bytes`), three ways, in nats per byte:

* windows: non-overlapping `--context`-byte windows, each read from a fresh start (what every
  model sees in training: nothing before its block);
* sliding: every target read with its model's trained block of bytes before it at most, in
  windows of the block moved `--stride` bytes at a time (default: a quarter of the block;
  each window scores its last `--stride` targets, read with block - stride + 1 to block
  bytes of context; the first window scores all of its targets): how a model with a window
  reads long text;
* stream: BDH only, the whole text read as one stream from a fresh state, the state carried
  from token to token (`evals.scoring.score_sequences`): how BDH reads long text, every
  byte before a target in its state.

A BDH arm whose config streams its state (`training.tbptt_persist_across_steps`, as the tiny
preset does) trains through the trainer's own loader and step (`StreamingDocumentLoader`,
`LanguageTrainModel` with the config's TBPTT chunks): its rows read documents of
`training.min_logical_block_size` bytes in consecutive blocks, the detached state carried
from each block to the next and reset where a document starts; its batches are therefore
not the other arms' windows. (Gradient-scale schedules and `stream_documents = "corpus"`
are not taken: the latter is refused.)

The GPT baseline: pre-norm decoder blocks (LayerNorm, causal multi-head attention with
rotary positions, LayerNorm, 4x GELU MLP, no biases), a final LayerNorm and an untied head;
as many layers and heads as the BDH preset (or the layers of each of `--gpt-layers`), its
width the one whose parameter count (`gpt_parameter_count`) is nearest BDH's. BDH's layers
share their weights, so its depth is compute and not size; the GPT's are each its own, so a
GPT of fewer layers is wider at equal size.

    python benchmarks/recipe.py --budgets 180,600 --presets tiny --optimizers adamw,muon
    python benchmarks/recipe.py --sweep --budgets 40 --presets tiny
    F=training.tbptt_persist_across_steps=false,training.min_logical_block_size=0
    python benchmarks/recipe.py --budgets 180 --bdh "rope, fresh blocks:model.position=rope,$F"

`--bdh LABEL:KEY=VALUE,...` adds a BDH arm of the preset with those overrides (its optimizer
is `optimizer.name` among them, else the first of `--optimizers`); `--no-preset-bdh` leaves
out the preset's own BDH arms. `--gpt LABEL:KEY=VALUE,...` adds GPT arms of the preset's
recipe with those overrides (model.dropout, optimizer.*), one per optimizer and depth, beside
the plain ones: the baseline gets the tuning BDH gets.

`--sweep` varies the BDH recipe one setting at a time (learning rate, warm-up, width against
neurons at equal parameters, block, dropout, weight decay, batch) at short budgets, beside
the preset's own recipe and the GPT baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import cpu_counters, fmt, machine_line, others_cpu_share, print_table
from torch import nn

from bdh_train.config import RunConfig, load_config
from bdh_train.data.loaders import StreamingDocumentLoader
from bdh_train.evals.scoring import score_sequences
from bdh_train.model.bdh import BDH
from bdh_train.model.config import BDHConfig
from bdh_train.train.allocator import configure_host_allocator
from bdh_train.train.optim import OptimizerConfig
from bdh_train.train.step import LanguageTrainModel

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
SWEEP = {
    "lr x0.5": ["optimizer.lr*0.5"],
    "lr x2": ["optimizer.lr*2"],
    "warm-up 0": ["optimizer.warmup_steps=0"],
    "warm-up 60": ["optimizer.warmup_steps=60"],
    "D/2, N x2": ["model.n_embd/2", "model.mlp_internal_dim_multiplier*4"],
    "D x2, N/2": ["model.n_embd*2", "model.mlp_internal_dim_multiplier/4"],
    "block/2, batch x2": ["training.block_size/2", "training.batch_size*2"],
    "block x2, batch/2": ["training.block_size*2", "training.batch_size/2"],
    "dropout 0.1": ["model.dropout=0.1"],
    "weight decay 0": ["optimizer.weight_decay=0.0"],
    "batch/2": ["training.batch_size/2"],
    "batch x2": ["training.batch_size*2"],
}
"""Sweep variants: 'key=value' sets a value, 'key*f' and 'key/f' scale the preset's. D/2 with
N x2 (and the reverse) keep H * D * N, so the parameters stay within the embedding's share."""


# ------------------------------------------------------------------------ GPT baseline
def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x [B, H, T, d] (pairs (i, i + d/2) turned by t * 10000^(-2i/d))."""
    _, _, seq_len, dim = x.shape
    half = dim // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = torch.arange(seq_len, dtype=torch.float32, device=x.device)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.out = nn.Linear(4 * dim, dim, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, dim = x.shape
        q, k, v = (
            t.view(batch, seq_len, self.heads, dim // self.heads).transpose(1, 2)
            for t in self.qkv(self.ln1(x)).split(dim, dim=-1)
        )
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(batch, seq_len, dim)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """Token embedding, `layers` pre-norm blocks, a final LayerNorm, an untied head;
    `forward(x, y)` is (logits, mean cross-entropy) as BDH's."""

    def __init__(self, vocab: int, layers: int, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.drop = nn.Dropout(dropout)
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # GPT-2's init: N(0, 0.02), residual outputs / sqrt(2 layers)
                residual = name.endswith(("proj.weight", "out.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.drop(self.embed(x))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())


def gpt_parameter_count(vocab: int, layers: int, dim: int) -> int:
    """Embedding and head 2 V D; per block 12 D^2 (qkv 3, proj 1, MLP 8) and two
    LayerNorms' 4 D; the final LayerNorm 2 D."""
    return 2 * vocab * dim + layers * (12 * dim * dim + 4 * dim) + 2 * dim


def gpt_width(vocab: int, layers: int, heads: int, target: int) -> int:
    """The width (a multiple of 2 * heads: rotary pairs) whose count is nearest `target`."""
    widths = range(2 * heads, 8192, 2 * heads)
    return min(widths, key=lambda d: abs(gpt_parameter_count(vocab, layers, d) - target))


# ------------------------------------------------------------------------ arms
@dataclass
class Arm:
    """One model with its recipe, its own batch order and its own clock."""

    model_name: str
    recipe: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    optim: OptimizerConfig
    block: int
    batch: int
    budget_s: float
    seed: int
    total_steps: int = 0
    """Steps to train (the schedule runs over them); 0: train for `budget_s` seconds."""
    bfloat16: bool = False
    """Forward passes under bfloat16 autocast (the config's `training.dtype`: BDH's as the
    trainer takes it on the CPU, the GPT's 'bfloat16' only); weights, optimizer and scoring
    stay float32."""
    elapsed: float = 0.0
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    order: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.order = torch.Generator().manual_seed(self.seed)

    @property
    def done(self) -> bool:
        if self.total_steps:
            return self.steps >= self.total_steps
        return self.elapsed >= self.budget_s

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def progress(self) -> float:
        """How far the schedule has run, 0 to 1: steps / `total_steps`, or seconds trained /
        the budget's seconds."""
        if self.total_steps:
            return min(self.steps / self.total_steps, 1.0)
        return min(self.elapsed / self.budget_s, 1.0)

    def lr(self) -> float:
        """Linear warm-up over steps, then constant or cosine over `progress`."""
        o = self.optim
        if self.steps < o.warmup_steps:
            return o.lr * (self.steps + 1) / o.warmup_steps
        if o.schedule == "constant":
            return o.lr
        progress = self.progress()
        return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * progress))

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision the arm's forward passes run in (`bfloat16`)."""
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bfloat16)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's loss on a batch, its forward in the arm's precision, and its gradients
        accumulated."""
        with self.autocast():
            loss = self.model(inputs, targets)[1]
        loss.backward()
        return loss

    def prime(self, train: torch.Tensor) -> None:
        """An untimed forward and backward on the first windows of `train`, gradients dropped:
        one-time start-up (thread pools, kernel choices) is not charged to the budget."""
        windows = train[: 2 * (self.block + 1)].view(2, self.block + 1)
        self.forward_backward(windows[:, :-1], windows[:, 1:])
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, train: torch.Tensor) -> None:
        """One timed optimizer step on the next windows of `train`."""
        started = time.perf_counter()
        starts = torch.randint(0, len(train) - self.block - 1, (self.batch,), generator=self.order)
        windows = torch.stack([train[s : s + self.block + 1] for s in starts.tolist()])
        self.set_lr()
        loss = self.forward_backward(windows[:, :-1], windows[:, 1:])
        self.finish_step(started, loss)

    def set_lr(self) -> None:
        """The schedule's learning rate (`lr`) into every parameter group, before a step."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()

    def finish_step(self, started: float, loss: torch.Tensor) -> None:
        """Clip, update, zero the gradients; count the step's seconds and loss."""
        if self.optim.grad_clip_norm > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.elapsed += time.perf_counter() - started
        self.steps += 1
        self.losses.append(loss.item())


@dataclass
class StreamedArm(Arm):
    """A BDH arm that carries its state across steps as the trainer does: the trainer's
    streaming loader over `train` and its train step (`LanguageTrainModel`, streaming, with
    the config's TBPTT chunks), both made by `prime`, off the clock."""

    logical_length: int = 0
    tbptt_chunk_size: int = 0
    tbptt_backprop_chunks: int = 1
    loader: StreamingDocumentLoader | None = None
    executor: LanguageTrainModel | None = None

    def prime(self, train: torch.Tensor) -> None:
        """The loader and the step, then `Arm.prime`'s untimed forward and backward."""
        self.loader = StreamingDocumentLoader(
            train.numpy(), self.block, self.batch, self.logical_length, self.seed
        )
        assert isinstance(self.model, BDH)
        self.executor = LanguageTrainModel(
            self.model,
            tbptt_chunk_size=self.tbptt_chunk_size,
            tbptt_backprop_chunks=self.tbptt_backprop_chunks,
            streaming=True,
            autocast=self.autocast,
        )
        super().prime(train)

    def step(self, train: torch.Tensor) -> None:
        started = time.perf_counter()
        if self.loader is None or self.executor is None:
            raise RuntimeError("a StreamedArm steps after prime(), which makes its loader")
        self.set_lr()
        out = self.executor.train_step(self.loader.next_batch())
        self.finish_step(started, out.loss)


@dataclass(frozen=True)
class Recipe:
    """A preset (or config files, which name their preset) and the `--set` overrides every arm
    of the run applies on top of it."""

    preset: str
    sets: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    """Config files layered instead of `preset` (each may extend a preset)."""

    def config(self, *overrides: str) -> RunConfig:
        preset = None if self.files else self.preset
        return load_config(self.files, [*self.sets, *overrides], preset=preset)


def overridden(recipe: Recipe, changes: Sequence[str]) -> list[str]:
    """Overrides from sweep changes ('key=value', 'key*f', 'key/f' of the recipe's value)."""
    base = recipe.config()
    out = []
    for change in changes:
        if "=" in change:
            out.append(change)
            continue
        op = "*" if "*" in change else "/"
        key, factor = change.split(op)
        section, name = key.split(".")
        value = getattr(getattr(base, section), name)
        new = value * float(factor) if op == "*" else value / float(factor)
        out.append(f"{key}={int(new) if isinstance(value, int) else new}")
    return out


def bdh_arm(
    recipe: Recipe,
    optimizer: str | None,
    changes: Sequence[str],
    budget: float,
    label: str,
    streamed: bool = True,
) -> Arm:
    """BDH of `recipe` with `changes` (a sweep variant's) and `optimizer` (None: the one the
    recipe names); a `StreamedArm` where the config carries the state across steps, unless
    not `streamed` (a caller that feeds the arm batches of its own)."""
    named = [] if optimizer is None else [f"optimizer.name='{optimizer}'"]
    cfg = recipe.config(*overridden(recipe, changes), *named)
    torch.manual_seed(cfg.training.seed)
    model = BDH(cfg.model)
    t = cfg.training
    made = ("BDH", label, model, cfg.optimizer.build(model), cfg.optimizer)
    shape = (t.block_size, t.batch_size, budget, t.seed)
    bf16 = t.bfloat16_autocast("cpu")
    if streamed and t.stream_documents == "corpus":
        raise SystemExit(f"error: {label}: training.stream_documents = 'corpus' is not raced here")
    if streamed and t.streaming:
        return StreamedArm(
            *made,
            *shape,
            bfloat16=bf16,
            logical_length=t.logical_block_size,
            tbptt_chunk_size=t.tbptt_chunk_size,
            tbptt_backprop_chunks=t.tbptt_backprop_chunks,
        )
    return Arm(*made, *shape, bfloat16=bf16)


def gpt_model(m: BDHConfig, target_params: int, layers: int = 0) -> GPT:
    """The GPT of the model config's vocabulary, heads and dropout, and its layers (or
    `layers`), whose width gives the parameter count nearest `target_params`."""
    layers = layers or m.n_layer
    dim = gpt_width(m.vocab_size, layers, m.n_head, target_params)
    return GPT(m.vocab_size, layers, dim, m.n_head, m.dropout)


def gpt_arm(
    recipe: Recipe,
    optimizer: str,
    target_params: int,
    budget: float,
    layers: int = 0,
    changes: Sequence[str] = (),
    label: str = "",
) -> Arm:
    """GPT with `recipe`'s optimizer settings and `changes` (overrides such as model.dropout
    or optimizer.lr; `label` names them); 'muon' orthogonalises its block matrices. `layers`
    (0: the recipe's n_layer) sets its depth, the width following for equal size."""
    cfg = recipe.config(*overridden(recipe, changes), f"optimizer.name='{optimizer}'")
    torch.manual_seed(cfg.training.seed)
    model = gpt_model(cfg.model, target_params, layers)
    hidden = [n for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    opt = cfg.optimizer.build(model, muon_names=hidden)
    t = cfg.training
    depth = f", {layers} layer{'s' if layers > 1 else ''}" if layers else ""
    label = f"{recipe.preset}'s ({optimizer}){depth}{f', {label}' if label else ''}"
    shape = (t.block_size, t.batch_size, budget, t.seed)
    # 'auto' is float32 for the GPT: on a CPU with AMX the tiny preset's GPT (width 96 to 136)
    # ran slower under bfloat16 autocast (0.94x at two layers, 0.78x at four) where BDH ran
    # 1.6x faster; a wider GPT (other presets) is unmeasured there
    bf16 = t.dtype == "bfloat16"
    return Arm("GPT", label, model, opt, cfg.optimizer, *shape, bfloat16=bf16)


@torch.no_grad()
def held_out_loss(model: nn.Module, held: torch.Tensor, context: int, max_bytes: int) -> float:
    """Mean loss (nats per byte) over the non-overlapping `context`-byte windows of the first
    `max_bytes` of `held`, each predicting its next bytes from a fresh start."""
    model.eval()
    total = count = 0.0
    starts = list(range(0, min(len(held), max_bytes) - context - 1, context))
    for i in range(0, len(starts), 16):
        windows = torch.stack([held[s : s + context + 1] for s in starts[i : i + 16]])
        _, loss = model(windows[:, :-1], windows[:, 1:])
        total += float(loss) * windows[:, 1:].numel()
        count += windows[:, 1:].numel()
    model.train()
    return total / count


@torch.no_grad()
def sliding_loss(model: nn.Module, held: torch.Tensor, window: int, stride: int, max_bytes: int):
    """Mean loss (nats per byte) over every target of the first `max_bytes` of `held` but the
    first, each read with at most `window` bytes before it: windows of `window` bytes moved
    `stride` at a time, each scoring its last `stride` targets (the first window all of
    them, the last window the fewer left), so past the first window a target is read with
    window - stride + 1 to window bytes before it."""
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in 1..window ({window}), got {stride}")
    text = held[: min(len(held), max_bytes)]
    if len(text) < window + 1:
        raise ValueError(f"{len(text)} bytes: a sliding window of {window} needs {window + 1}")
    pieces = [(0, 0)]  # (window start, first scored target within the window)
    scored = window  # targets 1..scored are scored
    while scored < len(text) - 1:
        end = min(scored + stride, len(text) - 1)  # the last target of the next window
        pieces.append((end - window, window - (end - scored)))
        scored = end
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(pieces), 16):
        rows = pieces[i : i + 16]
        windows = torch.stack([text[s : s + window + 1] for s, _ in rows])
        logits, _ = model(windows[:, :-1], windows[:, 1:])
        losses = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none")
        for row, (_, first) in enumerate(rows):
            total += float(losses[row, first:].sum())
            count += window - first
    model.train()
    return total / count


def stream_loss(model: BDH, held: torch.Tensor, max_bytes: int) -> float:
    """Mean loss (nats per byte) over the first `max_bytes` of `held` read as one stream from
    a fresh state, the state carried from token to token."""
    model.eval()
    (scores,) = score_sequences(model, [held[:max_bytes].tolist()], batch_size=1)
    model.train()
    return float(-scores.log_probs.mean())


def race(arms: list[Arm], train: torch.Tensor) -> float:
    """Alternate one step per unfinished arm until every arm has spent its budget; the share
    of the machine's CPUs other processes used meanwhile."""
    for arm in arms:
        arm.prime(train)
    before = cpu_counters()
    while not all(a.done for a in arms):
        for arm in arms:
            if not arm.done:
                arm.step(train)
    return others_cpu_share(before, cpu_counters())


@dataclass
class Scores:
    """An arm's held-out losses (nats per byte) and speed after its race."""

    windows: float
    sliding: float
    stream: float | None
    """BDH's state carried over the whole text; None for the GPT."""
    tok_s: float
    train_tail: float
    """Mean train loss over the steps every arm took (the last 10 of them)."""

    @property
    def used(self) -> float:
        """The loss of the reading the model is used with on long text: BDH's stream, the
        GPT's sliding window."""
        return self.sliding if self.stream is None else self.stream


def stride_for(arm: Arm, args: argparse.Namespace) -> int:
    """`--stride`, or a quarter of the arm's block (0)."""
    return args.stride or max(1, arm.block // 4)


def score(arm: Arm, held: torch.Tensor, common: int, args: argparse.Namespace) -> Scores:
    """`arm`'s `Scores` on `held`; `common`: the steps every arm took."""
    tail = arm.losses[max(common - 10, 0) : common]
    model = arm.model
    return Scores(
        windows=held_out_loss(model, held, args.context, args.eval_bytes),
        sliding=sliding_loss(model, held, arm.block, stride_for(arm, args), args.eval_bytes),
        stream=stream_loss(model, held, args.eval_bytes) if isinstance(model, BDH) else None,
        tok_s=arm.steps * arm.block * arm.batch / arm.elapsed,
        train_tail=sum(tail) / len(tail),
    )


def report(title: str, arms: list[Arm], held: torch.Tensor, args: argparse.Namespace) -> None:
    common = min(a.steps for a in arms)  # every arm saw these steps' shapes
    span = f"{max(common - 10, 0) + 1}-{common}"
    scores = {id(a): score(a, held, common, args) for a in arms}
    rows = []
    for a in arms:
        sc = scores[id(a)]
        rows.append(
            [
                a.model_name,
                a.recipe,
                "bfloat16" if a.bfloat16 else "float32",
                fmt(a.budget_s),
                f"{a.params:,}",
                a.steps,
                f"{a.steps * a.block * a.batch:,}",
                fmt(sc.tok_s),
                fmt(sc.train_tail, ".3f"),
                fmt(sc.windows, ".4f"),
                fmt(sc.sliding, ".4f"),
                fmt(sc.stream, ".4f"),
                fmt(sc.used / math.log(2), ".4f"),
            ]
        )
    headers = [
        "model",
        "recipe",
        "forward in",
        "budget s",
        "params",
        "steps",
        "tokens",
        "tok/s",
        f"train loss {span}",
        f"windows of {args.context}",
        f"sliding (stride {args.stride or 'block/4'})",
        "stream",
        "bits/byte as used",
    ]
    print_table(title, headers, rows)
    print()
    gpts = [a for a in arms if a.model_name == "GPT"]
    for b in (a for a in arms if a.model_name == "BDH"):
        sb = scores[id(b)]
        for g in gpts:
            sg = scores[id(g)]
            print(
                f"BDH {b.recipe} against GPT {g.recipe}: tokens/s x{sb.tok_s / sg.tok_s:.2f}; "
                f"held-out as used (BDH's {'stream' if sb.stream is not None else 'sliding'}, "
                f"the GPT's sliding window) {sb.used - sg.used:+.4f} nats/byte, on the same "
                f"windows {sb.windows - sg.windows:+.4f}; train loss over steps {span} "
                f"{sb.train_tail - sg.train_tail:+.3f}"
            )


def load_bytes(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    cut = int(len(data) * 0.9)
    return data[:cut], data[cut:]


def arm_spec(spec: str) -> tuple[str, list[str]]:
    """`--bdh`'s or `--gpt`'s 'LABEL:KEY=VALUE,...': the label and the overrides."""
    label, _, sets = spec.partition(":")
    return label, [c for c in sets.split(",") if c]


def layer_counts(text: str) -> list[int]:
    """`--gpt-layers`' value: layer counts of 1 or more, comma-separated."""
    refused = argparse.ArgumentTypeError(f"counts of 1 or more, comma-separated, not {text!r}")
    try:
        counts = [int(n) for n in text.split(",") if n]
    except ValueError:
        raise refused from None
    if any(n < 1 for n in counts):
        raise refused
    return counts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a text file (bytes)")
    parser.add_argument("--budgets", default="180,600", help="seconds of training per arm")
    parser.add_argument("--presets", default="tiny", help="BDH presets, comma-separated")
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="for every arm"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128, help="held-out window, bytes")
    parser.add_argument(
        "--stride",
        type=int,
        default=0,
        help="bytes a sliding window moves (scored per window); 0: a quarter of the block",
    )
    parser.add_argument(
        "--bdh",
        action="append",
        default=[],
        metavar="LABEL:KEY=VALUE,...",
        help="a BDH arm of the preset with these overrides (repeatable)",
    )
    parser.add_argument(
        "--gpt",
        action="append",
        default=[],
        metavar="LABEL:KEY=VALUE,...",
        help="GPT arms with these overrides beside the plain ones, one per optimizer and depth "
        "(repeatable)",
    )
    parser.add_argument(
        "--no-preset-bdh", action="store_true", help="only the --bdh arms of BDH (and the GPTs)"
    )
    parser.add_argument(
        "--gpt-layers",
        type=layer_counts,
        default=[],
        help="the GPT arms' depths, comma-separated (each as wide as equal parameters allow); "
        "default: the preset's n_layer",
    )
    parser.add_argument("--eval-bytes", type=int, default=65536)
    parser.add_argument("--sweep", action="store_true", help="vary the BDH recipe (SWEEP)")
    parser.add_argument(
        "--variants",
        default="",
        help="with --sweep: only these SWEEP names, separated by ';' (names hold commas)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    configure_host_allocator("auto", torch.device("cpu"))
    train, held = load_bytes(args.data)
    print(f"machine: {machine_line()}")
    print(
        f"data: {args.data} ({len(train):,} train bytes, {len(held):,} held-out); "
        f"threads {args.threads}; held-out: {args.eval_bytes} bytes in {args.context}-byte windows"
    )
    optimizers = args.optimizers.split(",")
    for budget in (float(b) for b in args.budgets.split(",")):
        for preset in args.presets.split(","):
            recipe = Recipe(preset, tuple(args.set))
            arms = []
            if args.sweep:
                chosen = [v.strip() for v in args.variants.split(";")] if args.variants else []
                unknown = [v for v in chosen if v not in SWEEP]
                if unknown:
                    parser.error(f"--variants: no variant {unknown[0]!r}; the names: {list(SWEEP)}")
                chosen = chosen or list(SWEEP)
                arms.append(bdh_arm(recipe, optimizers[0], [], budget, f"{preset}'s"))
                arms += [bdh_arm(recipe, optimizers[0], SWEEP[v], budget, v) for v in chosen]
            elif not args.no_preset_bdh:
                arms += [bdh_arm(recipe, o, [], budget, f"{preset}'s ({o})") for o in optimizers]
            for spec in args.bdh:
                label, changes = arm_spec(spec)
                named = any(c.startswith("optimizer.name=") for c in changes)
                arms.append(
                    bdh_arm(recipe, None if named else optimizers[0], changes, budget, label)
                )
            if not arms:
                parser.error("no BDH arm: --no-preset-bdh needs at least one --bdh")
            target = arms[0].params
            baselines = optimizers[:1] if args.sweep else optimizers
            depths = args.gpt_layers or [0]
            arms += [gpt_arm(recipe, o, target, budget, n) for o in baselines for n in depths]
            for spec in args.gpt:
                label, changes = arm_spec(spec)
                arms += [
                    gpt_arm(recipe, o, target, budget, n, changes, label)
                    for o in baselines
                    for n in depths
                ]
            load = os.getloadavg()[0]
            others = race(arms, train)
            report(
                f"{preset}, {budget:.0f} s per arm: load average {load:.1f} at the start, "
                f"{os.getloadavg()[0]:.1f} at the end; others used {others:.0%} of the CPUs",
                arms,
                held,
                args,
            )


if __name__ == "__main__":
    main()
