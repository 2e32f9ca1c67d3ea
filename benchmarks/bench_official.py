"""bdh-train's train step against the official BDH implementation, same weights, same batch.

For each config ((a) L4 D128 H4 x16, (b) L6 D256 H4 x32; vocab 256, dropout 0) and each
(T, B) of the grid, ONE process builds the baseline, copies its weights into bdh-train's
BDH (bdh_train.model.official.load_official_state_dict: the parameter names coincide), gives each
its own AdamW (lr 1e-3) and draws one random batch. After a warm-up step of each side the
steps ALTERNATE (baseline, bdh-train, baseline, bdh-train, ...; --steps timed steps each), so
a change in the machine's load slows both sides alike and their ratio stays meaningful.
tokens/s = B*T / step time, from the fastest timed step (the median in brackets).

The baseline's train step is the official train.py's: `logits, loss = model(x, y)`,
`loss.backward()`, `optimizer.step()`, `optimizer.zero_grad()`. bdh-train's is
`LanguageTrainModel.train_step(batch)` + `optimizer.step()` (what the trainer runs).

Baseline model: by default `OfficialBaseline` below, a re-implementation of the official
`bdh.py` forward written out the way it is (rope with float32 phases, scores =
(QR @ QR^T).tril(diagonal=-1), scores @ V over the full T x T matrix, its parameter-free
layernorms, relu, dropout, lm_head, cross-entropy) and with its state_dict keys. With
`--official PATH` the official file itself (a copy of pathwaycom/bdh's `bdh.py`; it is not
part of this repository) is imported and timed: its `BDH(BDHConfig(...))` is built and its
own weights are copied into bdh-train's model. At start the script prints the largest logit
difference between the baseline and bdh-train on the same weights (T=64, B=2) and stops if
the built-in baseline is off by more than 1e-4 (fp32): the two must compute one function.

Memory: one fresh subprocess per side, malloc left as it is (a retaining heap's peak
would count its freed blocks; see _common.py for the method: a primed process's lifetime
peak RSS minus its RSS after setup, i.e. what one train step adds; on CUDA
torch.cuda.max_memory_allocated minus the allocated bytes after setup). Measured at the
largest T*B of each config's grid (--memory all: every point; none: skip; or a list of TxB
points) for the baseline, bdh-train, and bdh-train with `model.set_recompute("layer")` where
the model has it (BDH.set_recompute; "n/a" in the table where it does not exist).

Matmul ceiling and the share of it reached: the fp32 (or bf16) matmul rate of this machine is
measured once (a 2048^3 product on CPU, 8192^3 on CUDA). A train step's floating-point work
is counted from the multiply-adds of each side's executed form, per token:

    forward MACs/token = L * (3*H*D*N + H*C*(N + D) + H*N*D*(2 + K/C)) + D*V
    train FLOPs/token  = 2 (flops per MAC) * 3 (forward + backward = 3 forwards) * forward MACs
                         (the K/C term twice, not three times: see below)
                         - 2 * L * H * C * N where the scores' gradient is one product

3*H*D*N: the encoder, encoder_v and decoder projections; H*C*(N + D): the C x C score block
of each chunk (C*N per token) and its product with the values (C*D); 2*H*N*D: every chunk
reads its state (q @ S_k) and writes its part (q^T @ v); H*N*D*K/C: the K chunk states as
one [K, K] product over the K chunk writes (its [K, K] factor is a constant, so backward
computes one product for it, not two); with the hand-written backward on the CPU they are
running sums instead, whose adds are not counted (chunked_grad.sums_by_product); D*V:
lm_head (C | T assumed in the formula; the code counts exactly: the last chunk is zero-
padded to C tokens and computed as such). For bdh-train C is its chunk size when its
executor is chunked (C = T and no state term when dense); for the baseline's masked dense
form C = T and the state term is 0. The masked half of each score block is counted, because
it is computed. bdh-train's fp32 executors (no learned decay) take the gradient of the
symmetric score block Q Q^T as one product, (dA + dA^T) Q (model/chunked_grad.py), where
autograd (the baseline; bf16 autocast; compile) takes two. bdh-train's fp32 dense executor
computes its scores in row panels of P queries where the device's calibration sets P (CPU:
128): each query then covers (T + P) / 2 keys on average in Q Q^T, A V, dOut V^T and A^T
dOut, and all T in the symmetric (dA + dA^T) Q.
"% peak" = FLOPs/token * tokens/s / ceiling.

Run:  .venv/bin/python benchmarks/bench_official.py                  # the default grid, CPU
      .venv/bin/python benchmarks/bench_official.py --configs a --grid 512x8 --steps 3
      .venv/bin/python benchmarks/bench_official.py --official /tmp/official_bdh/bdh.py
      .venv/bin/python benchmarks/bench_official.py --compile pointwise   # the fused gate
      .venv/bin/python benchmarks/bench_official.py --device cuda --dtype bf16 --compile layer
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    CONFIGS,
    emit,
    load_average,
    machine_line,
    matmul_gflops,
    peak_rss_mib,
    print_table,
    run_worker,
    settle_baseline,
    worker_spec,
)
from torch import nn

from bdh_train.batch import SequenceBatch
from bdh_train.model import BDH
from bdh_train.model.bdh import COMPILE_MODES, compile_mode_for
from bdh_train.model.chunked_grad import sums_by_product
from bdh_train.model.mixer import calibration_for, dense_keys_per_query, resolve_executor
from bdh_train.model.official import load_official_state_dict
from bdh_train.train.allocator import HOST_ALLOCATORS, configure_host_allocator
from bdh_train.train.step import LanguageTrainModel

VOCAB = 256
LR = 1e-3
TRAIN_EXECUTORS = ("auto", "dense", "chunked")  # the recurrent executor is for generation
CHECK_T, CHECK_B = 64, 2
CHECK_TOLERANCE = 1e-4  # fp32 logits, built-in baseline against bdh-train
DEFAULT_GRID: dict[str, tuple[tuple[int, int], ...]] = {
    "a": ((512, 8), (2048, 2), (2048, 8)),
    "b": ((512, 4),),
}
"""(T, B) per config: the default grid."""


# --------------------------------------------------------------------- the baseline
class _OfficialAttention(nn.Module):
    """The official Attention: rope with float32 phases, then the masked dense product."""

    def __init__(self, n_neurons: int):
        super().__init__()
        i = torch.arange(0, n_neurons, 1, dtype=torch.float32)
        quantized = (i / 2).floor() * 2
        theta = 2**16
        freqs = 1.0 / (theta ** (quantized / n_neurons)) / (2 * math.pi)
        self.register_buffer("freqs", freqs.view(1, 1, 1, n_neurons))

    @staticmethod
    def rope(phases: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        v_rot = torch.stack((-v[..., 1::2], v[..., ::2]), dim=-1).view(*v.size())
        phases = (phases % 1) * (2 * math.pi)
        return (v * torch.cos(phases)).to(v.dtype) + (v_rot * torch.sin(phases)).to(v.dtype)

    def forward(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seq_len = q.size(2)
        positions = torch.arange(0, seq_len, device=self.freqs.device, dtype=self.freqs.dtype)
        qr = self.rope(positions.view(1, 1, -1, 1) * self.freqs, q)
        scores = (qr @ qr.mT).tril(diagonal=-1)
        return scores @ v


class OfficialBaseline(nn.Module):
    """The official pathwaycom/bdh model's forward, step for step, with its state_dict keys
    (decoder, encoder, encoder_v, embed.weight, lm_head, attn.freqs) and its init."""

    def __init__(
        self,
        n_layer: int,
        n_embd: int,
        n_head: int,
        mlp_internal_dim_multiplier: int,
        vocab_size: int = VOCAB,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.n_layer, self.n_embd, self.n_head = n_layer, n_embd, n_head
        self.n_neurons = mlp_internal_dim_multiplier * n_embd // n_head
        h, d, n = n_head, n_embd, self.n_neurons
        self.decoder = nn.Parameter(torch.zeros((h * n, d)).normal_(std=0.02))
        self.encoder = nn.Parameter(torch.zeros((h, d, n)).normal_(std=0.02))
        self.attn = _OfficialAttention(n)
        self.ln = nn.LayerNorm(d, elementwise_affine=False, bias=False)
        self.embed = nn.Embedding(vocab_size, d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.drop = nn.Dropout(dropout)
        self.encoder_v = nn.Parameter(torch.zeros((h, d, n)).normal_(std=0.02))
        self.lm_head = nn.Parameter(torch.zeros((d, vocab_size)).normal_(std=0.02))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, seq_len = idx.size()
        d, h, n = self.n_embd, self.n_head, self.n_neurons
        x = self.ln(self.embed(idx).unsqueeze(1))  # [B, 1, T, D]
        for _ in range(self.n_layer):
            x_sparse = F.relu(x @ self.encoder)  # [B, H, T, N]
            y_kv = self.ln(self.attn(x_sparse, x))
            y_sparse = F.relu(y_kv @ self.encoder_v)
            xy_sparse = self.drop(x_sparse * y_sparse)
            y_mlp = xy_sparse.transpose(1, 2).reshape(batch, 1, seq_len, n * h) @ self.decoder
            x = self.ln(x + self.ln(y_mlp))
        logits = x.view(batch, seq_len, d) @ self.lm_head
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def load_official_module(path: str) -> ModuleType:
    """Import a copy of the official bdh.py from `path` (it needs only torch)."""
    file = Path(path)
    if not file.is_file():
        raise SystemExit(
            f"error: --official {path}: no such file (a copy of pathwaycom/bdh's bdh.py)"
        )
    spec = importlib.util.spec_from_file_location("official_bdh", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("BDH", "BDHConfig"):
        if not hasattr(module, name):
            raise SystemExit(f"error: --official {path} defines no {name}: not the official bdh.py")
    return module


def build_baseline(shape: dict[str, int], official: ModuleType | None) -> nn.Module:
    """The baseline model of a config shape (CONFIGS' fields; official init, dropout 0)."""
    if official is None:
        return OfficialBaseline(**shape, vocab_size=VOCAB, dropout=0.0)
    return official.BDH(official.BDHConfig(**shape, vocab_size=VOCAB, dropout=0.0))


def ours_from_baseline(baseline: nn.Module, executor: str) -> BDH:
    """bdh-train's BDH holding the baseline's weights (dropout 0), on the CPU."""
    state = {k: v.detach().cpu() for k, v in baseline.state_dict().items()}
    model = load_official_state_dict(state, n_layer=baseline_layers(baseline))
    model.config.executor = executor
    return model


def baseline_layers(baseline: nn.Module) -> int:
    return baseline.n_layer if isinstance(baseline, OfficialBaseline) else baseline.config.n_layer


def max_logit_difference(baseline: nn.Module, ours: BDH, device: torch.device) -> float:
    """max |logits_baseline - logits_ours| on a random (CHECK_B, CHECK_T) batch, fp32, eval."""
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, VOCAB, (CHECK_B, CHECK_T), generator=g).to(device)
    was = baseline.training, ours.training
    baseline.eval()
    ours.eval()
    with torch.no_grad():
        theirs, _ = baseline(idx)
        mine, _ = ours(idx)
    baseline.train(was[0])
    ours.train(was[1])
    return (theirs.float() - mine.float()).abs().max().item()


# --------------------------------------------------------------------- steps
def random_batch(seq_len: int, batch: int, device: torch.device) -> SequenceBatch:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch, seq_len + 1), generator=g).to(device)
    return SequenceBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def autocast_factory(
    device: torch.device, dtype: str
) -> Callable[[], contextlib.AbstractContextManager]:
    if dtype == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def baseline_stepper(model: nn.Module, autocast, compile_model: bool):
    """The official train.py's step: forward with targets, backward, AdamW step, zero_grad."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    forward = torch.compile(model) if compile_model else model
    model.train()

    def step(batch: SequenceBatch) -> None:
        with autocast():
            _, loss = forward(batch.inputs, batch.targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def ours_stepper(model: BDH, autocast, compile_mode: str, recompute: str = "none"):
    """bdh-train's step: LanguageTrainModel.train_step (zero_grad, forward, backward) + AdamW;
    `compile_mode`: training.compile's."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model.compile_for_training(compile_mode)
    if recompute != "none":
        model.set_recompute(recompute)
    train = LanguageTrainModel(model, autocast=autocast)

    def step(batch: SequenceBatch) -> None:
        train.train_step(batch)
        optimizer.step()

    return step


def timed(
    step: Callable[[SequenceBatch], None], batch: SequenceBatch, device: torch.device
) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


# --------------------------------------------------------------------- work counts
def ours_executor(model: BDH, seq_len: int, dtype: str = "fp32") -> tuple[int | None, int]:
    """(chunk length or None for dense (no state term), dense's panel rows of the device: 0
    for the whole matrix) of bdh-train's executor at T; `dtype` bf16: under bf16 autocast,
    which has its own calibration."""
    c = model.config
    device_type = model.embed.weight.device.type
    compute_dtype = torch.bfloat16 if dtype == "bf16" else None
    executor, chunk_size = resolve_executor(
        c.executor, seq_len, c.n_neurons, c.n_embd, c.chunk_size, device_type, compute_dtype
    )
    if executor == "chunked":  # one chunk of C >= T: the whole matrix, no state term
        return (chunk_size if chunk_size < seq_len else None), 0
    return None, calibration_for(device_type, compute_dtype).dense_panel_rows


def train_flops_per_token(
    shape: dict[str, int],
    seq_len: int,
    chunk: int | None,
    symmetric_backward: bool = False,
    panel_rows: int = 0,
    states_by_product: bool = True,
) -> float:
    """2 * 3 * forward MACs per token (formula in the module docstring); chunk None = dense;
    `symmetric_backward`: the scores' gradient is one product, not two; `panel_rows`: dense
    computes the scores in row panels (keys per query `dense_keys_per_query`, except the
    scores' gradient product (dA + dA^T) Q, which covers all T); `states_by_product`: the
    chunk states are the [K, K] product, not running sums (`chunked_grad.sums_by_product`;
    a sum's adds, like every elementwise pass, are not counted)."""
    layers, d, h = shape["n_layer"], shape["n_embd"], shape["n_head"]
    n = shape["mlp_internal_dim_multiplier"] * d // h
    block, state, carry = float(seq_len), 0.0, 0.0
    if chunk is None and panel_rows:
        assert symmetric_backward, "panels run only with the hand-written backward"
        keys = dense_keys_per_query(seq_len, panel_rows)
        # forward Q Q^T and A V, backward dOut V^T and A^T dOut over the panels' keys; the
        # symmetric dQ product over all T keys (one product, so no second one to save)
        macs = h * (keys * (n + d) + keys * 2 * d + seq_len * n)
        scores = 2 * layers * macs
        rest = 2 * 3 * (layers * 3 * h * d * n + d * VOCAB)
        return rest + scores
    if chunk is not None:  # all chunks at once, the last one zero-padded to C tokens
        chunks = -(-seq_len // chunk)
        block = chunks * chunk * chunk / seq_len  # a C x C score block per chunk
        # every chunk reads its state and writes its part (C N D each)
        state = h * n * d * 2 * chunks * chunk / seq_len
        # the chunk states: one [K, K] product over the chunk writes (K^2 N D); its [K, K]
        # factor is a constant, so backward computes only the writes' gradient
        if states_by_product:
            carry = layers * h * n * d * chunks * chunks / seq_len
    forward = layers * (3 * h * d * n + h * block * (n + d) + state) + d * VOCAB
    saved = layers * h * block * n if symmetric_backward else 0.0
    return 2 * (3 * forward + 2 * carry - saved)


def hand_written_backward(args: argparse.Namespace) -> bool:
    """Whether bdh-train's executor runs with the hand-written backward (fp32 or fp64 without
    autocast or compile; the benchmark's configs use rope, no learned decay)."""
    return args.dtype == "fp32" and not layer_compiled(args.compile, args.device)


def layer_compiled(compile_mode: str, device: str) -> bool:
    """Whether bdh-train compiles its whole layer: then the baseline is compiled too (as the
    official train.py compiles its model; the fused gate has no official twin), and
    bdh-train's executors take autograd's products."""
    return compile_mode_for(compile_mode, torch.device(device)) == "layer"


def compile_note(args: argparse.Namespace) -> str:
    """The title's words on compiling: nothing when neither side compiles."""
    mode = compile_mode_for(args.compile, torch.device(args.device))
    if mode == "off":
        return ""
    if mode == "layer":
        return ", both compiled (bdh-train's layer, the baseline's model)"
    return f", bdh-train compile {mode!r} (the baseline eager)"


def matmul_ceiling_gflops(device: torch.device, dtype: str, threads: int) -> float:
    """The machine's dense matmul rate (best of 3): fp32 on CPU, the benchmark's dtype on CUDA."""
    if device.type != "cuda":
        return matmul_gflops(threads)
    size = 8192
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(size, size, device=device, dtype=tdtype)
    b = torch.randn(size, size, device=device, dtype=tdtype)
    a @ b
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        a @ b
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


# --------------------------------------------------------------------- memory worker
def memory_worker(spec: dict[str, Any]) -> None:
    """One side's train step in a fresh process: the memory it adds over a primed process."""
    device = torch.device(spec["device"])
    torch.set_num_threads(spec["threads"])
    # Memory is measured with malloc as it is: a retaining heap's peak counts freed blocks.
    configure_host_allocator("system", device)
    torch.manual_seed(0)
    official = load_official_module(spec["official"]) if spec["official"] else None
    baseline = build_baseline(CONFIGS[spec["config"]], official).to(device)
    autocast = autocast_factory(device, spec["dtype"])
    if spec["side"] == "baseline":
        step = baseline_stepper(baseline, autocast, layer_compiled(spec["compile"], spec["device"]))
    else:
        ours = ours_from_baseline(baseline, spec["executor"]).to(device)
        del baseline
        step = ours_stepper(ours, autocast, spec["compile"], spec["recompute"])
    batch = random_batch(spec["seq_len"], spec["batch"], device)
    step(random_batch(16, spec["batch"], device))  # thread pools, gradients, AdamW state
    if device.type == "cuda":
        step(batch)  # compile/caches for the full shape, then measure a second full step
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / 2**20
        step(batch)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        base = settle_baseline()
        step(batch)
        peak = peak_rss_mib()
    emit({"base_mib": base, "peak_mib": peak, "delta_mib": peak - base})


def measure_memory(args, config: str, seq_len: int, batch: int, side: str, recompute: str):
    spec = {
        "config": config,
        "seq_len": seq_len,
        "batch": batch,
        "side": side,
        "recompute": recompute,
        "device": args.device,
        "dtype": args.dtype,
        "compile": args.compile,
        "executor": args.executor,
        "threads": args.threads,
        "official": args.official,
    }
    return run_worker(os.path.abspath(__file__), spec, timeout_s=args.timeout_s)


# --------------------------------------------------------------------- parent
def parse_grid(text: str) -> tuple[tuple[int, int], ...]:
    """'512x8,2048x2' -> ((512, 8), (2048, 2))."""
    points = []
    for item in text.split(","):
        t, _, b = item.strip().partition("x")
        if not (t.isdigit() and b.isdigit()) or int(t) < 1 or int(b) < 1:
            raise SystemExit(f"error: --grid item {item!r} is not TxB (e.g. 512x8)")
        points.append((int(t), int(b)))
    return tuple(points)


def memory_grid(option: str, grid: tuple[tuple[int, int], ...]) -> set[tuple[int, int]]:
    """The (T, B) points of `grid` whose memory --memory asks for."""
    if option == "none":
        return set()
    if option == "all":
        return set(grid)
    if option == "largest":
        return {max(grid, key=lambda p: p[0] * p[1])}
    return set(parse_grid(option)) & set(grid)


def run_point(args, config: str, seq_len: int, batch_size: int, official, device) -> dict[str, Any]:
    """Alternating timed steps of both sides at one (T, B); each side's step times."""
    torch.manual_seed(0)
    baseline = build_baseline(CONFIGS[config], official).to(device)
    ours = ours_from_baseline(baseline, args.executor).to(device)
    autocast = autocast_factory(device, args.dtype)
    steps = {
        "baseline": baseline_stepper(baseline, autocast, layer_compiled(args.compile, args.device)),
        "bdh-train": ours_stepper(ours, autocast, args.compile, args.recompute),
    }
    batch = random_batch(seq_len, batch_size, device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    warm = {name: timed(step, batch, device) for name, step in steps.items()}
    print(f"  T={seq_len} B={batch_size} warm-up (s): {warm}", file=sys.stderr, flush=True)
    load = load_average()
    for i in range(args.steps):
        for name, step in steps.items():
            times[name].append(timed(step, batch, device))
            print(
                f"  T={seq_len} B={batch_size} timed step {i + 1} {name}: {times[name][-1]:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    chunk, panel_rows = ours_executor(ours, seq_len, args.dtype)
    if not hand_written_backward(args):  # the autograd form computes the whole matrix
        panel_rows = 0
    return {"warm": warm, "times": times, "load": load, "chunk": chunk, "panel_rows": panel_rows}


def self_check(official, device, configs) -> None:
    """Baseline and bdh-train compute one function: logits on the same weights."""
    for config in configs:
        torch.manual_seed(0)
        baseline = build_baseline(CONFIGS[config], official).to(device)
        ours = ours_from_baseline(baseline, "auto").to(device)
        diff = max_logit_difference(baseline, ours, device)
        which = "official bdh.py" if official is not None else "built-in baseline"
        print(f"check ({config}): max |logits {which} - bdh-train| = {diff:.2e} (T={CHECK_T})")
        if official is None and not diff <= CHECK_TOLERANCE:
            raise SystemExit(
                f"error: the built-in baseline differs from bdh-train by {diff:.2e} > "
                f"{CHECK_TOLERANCE}: it no longer computes the official model"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="a,b", help="comma list of a,b")
    ap.add_argument(
        "--grid",
        default=None,
        help="comma list of TxB for every config (default: a: 512x8,2048x2,2048x8; b: 512x4)",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each side (>= 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast")
    ap.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="off",
        help="bdh-train's training.compile; where it resolves to 'layer', the baseline is "
        "torch.compile(model), as train.py (default off)",
    )
    ap.add_argument(
        "--executor",
        choices=TRAIN_EXECUTORS,
        default="auto",
        help="bdh-train's executor (auto: dense or chunked by mixer.choose_executor)",
    )
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default 2 on CPU)")
    ap.add_argument(
        "--official", default=None, metavar="PATH", help="a copy of the official bdh.py"
    )
    ap.add_argument(
        "--memory",
        default="largest",
        help="where to measure memory: 'largest' (each config's largest T*B point), 'all', "
        "'none', or a comma list of TxB points",
    )
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per memory subprocess")
    ap.add_argument(
        "--recompute",
        choices=("none", "layer", "mixer"),
        default="none",
        help="bdh-train's training.recompute in the timed steps (the memory table always "
        "measures none and layer)",
    )
    ap.add_argument(
        "--host-allocator",
        choices=HOST_ALLOCATORS,
        default="auto",
        help="the process's malloc policy, for both sides (training.host_allocator; default "
        "auto, what the trainer uses)",
    )
    args = ap.parse_args()
    if args.steps < 1:
        raise SystemExit("error: --steps must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    args.threads = args.threads or (2 if args.device == "cpu" else torch.get_num_threads())
    torch.set_num_threads(args.threads)
    if args.official:
        args.official = os.path.abspath(args.official)
    official = load_official_module(args.official) if args.official else None
    configs = [c.strip() for c in args.configs.split(",")]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"error: --configs {c!r}: known configs are {', '.join(CONFIGS)}")
    device = torch.device(args.device)
    allocator = configure_host_allocator(args.host_allocator, device)
    print(f"machine: {machine_line()}")
    print(f"host allocator (both sides, this process): {allocator}")
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    ceiling = matmul_ceiling_gflops(device, args.dtype, args.threads)
    ceiling_dtype = args.dtype if device.type == "cuda" else "fp32"
    print(
        f"matmul ceiling ({ceiling_dtype}, {args.device}, {args.threads} threads): "
        f"{ceiling:.0f} GFLOP/s"
    )
    self_check(official, device, configs)
    has_recompute = hasattr(BDH, "set_recompute")
    started = time.perf_counter()
    rows = []
    for config in configs:
        grid = parse_grid(args.grid) if args.grid else DEFAULT_GRID[config]
        memory_points = memory_grid(args.memory, grid)
        for seq_len, batch_size in grid:
            r = run_point(args, config, seq_len, batch_size, official, device)
            tokens = seq_len * batch_size
            rate = {k: tokens / min(v) for k, v in r["times"].items()}
            median = {k: tokens / statistics.median(v) for k, v in r["times"].items()}
            share = {
                "baseline": train_flops_per_token(CONFIGS[config], seq_len, None)
                * rate["baseline"],
                "bdh-train": train_flops_per_token(
                    CONFIGS[config],
                    seq_len,
                    r["chunk"],
                    hand_written_backward(args),
                    r["panel_rows"],
                    sums_by_product(args.device) or not hand_written_backward(args),
                )
                * rate["bdh-train"],
            }
            memory = {"baseline": None, "bdh-train": None, "layer": None}
            if (seq_len, batch_size) in memory_points:
                memory["baseline"] = measure_memory(
                    args, config, seq_len, batch_size, "baseline", "none"
                )
                memory["bdh-train"] = measure_memory(
                    args, config, seq_len, batch_size, "ours", "none"
                )
                if has_recompute:
                    memory["layer"] = measure_memory(
                        args, config, seq_len, batch_size, "ours", "layer"
                    )

            def mib(m: dict[str, Any] | None, available: bool = True) -> str:
                if not available:
                    return "n/a"
                if m is None:
                    return "-"
                return f"{m['delta_mib']:.0f}" if "delta_mib" in m else m["error"][:48]

            executor = "dense" if r["chunk"] is None else f"chunked/{r['chunk']}"
            if r["chunk"] is None and args.executor == "chunked":
                executor = "chunked (1 chunk)"
            rows.append(
                (
                    config,
                    seq_len,
                    batch_size,
                    executor,
                    f"{rate['baseline']:.0f} ({median['baseline']:.0f})",
                    f"{rate['bdh-train']:.0f} ({median['bdh-train']:.0f})",
                    f"{rate['bdh-train'] / rate['baseline']:.2f}x",
                    f"{100 * share['baseline'] / (ceiling * 1e9):.0f}",
                    f"{100 * share['bdh-train'] / (ceiling * 1e9):.0f}",
                    mib(memory["baseline"]),
                    mib(memory["bdh-train"]),
                    mib(memory["layer"], has_recompute or memory["baseline"] is None),
                    f"{r['load']:.1f}",
                )
            )
            print(
                f"[{time.perf_counter() - started:6.0f} s] ({config}) T={seq_len} B={batch_size}: "
                f"warm-up {r['warm']['baseline']:.2f}/{r['warm']['bdh-train']:.2f} s, steps "
                f"baseline {', '.join(f'{x:.2f}' for x in r['times']['baseline'])} s, bdh-train "
                f"{', '.join(f'{x:.2f}' for x in r['times']['bdh-train'])} s",
                file=sys.stderr,
                flush=True,
            )
    which = (
        "official bdh.py (--official)"
        if official is not None
        else "built-in official re-implementation"
    )
    title = (
        f"bdh-train vs {which}: {args.device}, {args.dtype}"
        f"{compile_note(args)}, {args.threads} threads, executor "
        f"{args.executor}, recompute {args.recompute}, host allocator {allocator}; steps "
        f"alternate, 1 warm-up + {args.steps} timed each. tokens/s: "
        "fastest step (median); ratio = bdh-train / baseline (fastest); % peak: share of the "
        f"{ceiling:.0f} GFLOP/s {ceiling_dtype} matmul ceiling (FLOPs of each side's executed "
        "form); memory: MiB a train step adds (fresh process each; '-' not measured, 'n/a' "
        "no set_recompute); load: 1-min load average"
    )
    headers = (
        "cfg",
        "T",
        "B",
        "bdh-train executor",
        "baseline tok/s",
        "bdh-train tok/s",
        "ratio",
        "baseline % peak",
        "bdh-train % peak",
        "baseline MiB",
        "bdh-train MiB",
        "recompute=layer MiB",
        "load",
    )
    print_table(title, headers, rows)
    print(f"\ntotal wall time {(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    _spec = worker_spec()
    if _spec is not None:
        memory_worker(_spec)
    else:
        main()
