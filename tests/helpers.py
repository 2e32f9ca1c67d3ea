"""The tests' toolbox: tiny models, one closeness check, one multi-process launcher, and
what the official pathwaycom/bdh code builds (for tests that load official checkpoints).

Importable as `helpers` from every test (pyproject's pytest `pythonpath` puts tests/ on
sys.path, and spawned worker processes inherit that path).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import math
import multiprocessing
import os
import stat
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bdh_train.model import BDH, BDHConfig
from bdh_train.train.throughput import IN_PLACE_PRODUCTS  # noqa: F401 (the tests' import)

TEST_THREADS = max(1, 2 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
"""Torch threads in every test (suite_setup.py): the machine's two cores, shared by the
pytest-xdist workers that `make test` starts (2 workers: 1 thread each)."""

TEST_SAMPLE_TOKENS = 8
"""How many tokens an end-of-run sample continues by in a test's run (`short_run_end`)."""


TEST_PEAK_FLOPS = 1e11
"""The peak every test's run divides by for its MFU (`constant_peak`)."""


def _as_a_test_process() -> None:
    """In a process forked for a test (a rank, a command of its own): one torch thread, and
    runs that end and count their MFU as the test's own process's runs do."""
    torch.set_num_threads(1)
    short_run_end(setattr)
    constant_peak(setattr)


def constant_peak(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Through `setattr_`: a run's peak is TEST_PEAK_FLOPS, a constant, not a measurement (four
    1024-square products: 0.13 s of one core in every run, up to 0.7 s under the load of a
    multi-process test); tests/train/test_throughput.py measures."""
    from bdh_train.train import throughput

    setattr_(throughput, "measure_peak_flops", lambda device, dtype: TEST_PEAK_FLOPS)


def short_run_end(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Through `setattr_` (a monkeypatch's, or `setattr` in a process of its own): a run
    ends with samples of TEST_SAMPLE_TOKENS tokens (the printing path still runs) and
    without the state-gain line (a context curve over the validation split: up to seconds),
    as one whose validation split is shorter than one stretch does."""
    from bdh_train.training.trainer import Trainer

    setattr_(Trainer, "state_gain", lambda self: None)
    setattr_(Trainer, "end_sample_tokens", TEST_SAMPLE_TOKENS)


# ------------------------------------------------------------------ tiny models
def tiny_config(**overrides) -> BDHConfig:
    """A model config small enough that every test is fast on two CPU cores."""
    base = dict(
        n_layer=2,
        n_embd=16,
        n_head=2,
        mlp_internal_dim_multiplier=4,
        vocab_size=32,
        dropout=0.0,
        chunk_size=4,
    )
    base.update(overrides)
    return BDHConfig(**base)


def tiny_model(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> BDH:
    torch.manual_seed(seed)
    return BDH(tiny_config(**overrides)).to(dtype)


# ------------------------------------------------------------------ closeness
Tensors = torch.Tensor | Mapping[str, torch.Tensor]


def _flat(x: Tensors) -> torch.Tensor:
    if isinstance(x, Mapping):
        return torch.cat([t.detach().double().reshape(-1) for t in x.values()])
    return torch.as_tensor(x).detach().double().reshape(-1)


def assert_close(
    actual: Tensors, expected: Tensors, *, rtol: float, atol: float = 0.0, msg: str = ""
) -> None:
    """Norm-relative closeness: ||actual - expected|| <= atol + rtol * ||expected||.

    The 2-norm is taken in float64 over all elements. Per-element relative error is dominated
    by cancellation in tiny entries; the norm of the whole difference is not. `actual` and
    `expected` may be tensors (any shape, 0-d included) or dicts of tensors with the same keys,
    which are checked as one vector (all entries concatenated in `expected`'s key order).
    """
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{msg}: expected a dict of tensors"
        assert actual.keys() == expected.keys(), f"{msg}: keys {actual.keys()} != {expected.keys()}"
        actual = {name: actual[name] for name in expected}
    a, e = _flat(actual), _flat(expected)
    assert a.shape == e.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    diff = (a - e).norm().item()
    ref = e.norm().item()
    if diff <= atol + rtol * ref:
        return
    rel = diff / ref if ref > 0 else math.inf
    raise AssertionError(
        f"{msg}: norm-relative error {rel:.3e} (absolute {diff:.3e}) exceeds "
        f"rtol={rtol:g}, atol={atol:g}"
    )


# ------------------------------------------------------------------ multi-process launcher
def _worker(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    out_dir: str,
    timeout: float,
    args: tuple[Any, ...],
) -> None:
    """One process: join the gloo group, run fn, save its result (or traceback) to a file,
    and leave the group only when every rank has finished fn (`_wait_for_peers`)."""
    _as_a_test_process()
    out = Path(out_dir)
    deadline = time.monotonic() + timeout
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out / 'store'}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world, *args)
        (out / f"rank{rank}.done").touch()
        torch.save(result, out / f"rank{rank}.pt")
        _wait_for_peers(out, world, deadline)
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_for_peers(out: Path, world: int, deadline: float) -> None:
    """Return once every rank has finished fn (its rank*.done) or failed (rank*.err), or at
    `deadline`. A rank's last collective can end sooner for it than for a peer: the source
    of a broadcast returns once it has sent (a pipeline's eval_loss ends with one). Leaving
    the group then closes its gloo connections while the peer is still reading, and under
    load the peer failed with gloo's "Connection closed by peer". The files are the
    rendezvous because a gloo barrier would end with the same race on its own messages."""
    while time.monotonic() < deadline:
        if all((out / f"rank{r}.done").exists() or (out / f"rank{r}.err").exists()
               for r in range(world)):  # fmt: skip
            return
        time.sleep(0.01)


FORKSERVER_PRELOAD = [
    "helpers",
    "bdh_train.training.trainer",
    "bdh_train.distributed.pipeline",
    "torch._dynamo",  # imported by the first torch.optim optimizer a process builds
    "torch.distributed.checkpoint",  # a sharded run's checkpoints
    "torch.distributed.fsdp",
    "matplotlib.figure",  # a run's loss plot
    "matplotlib.backends.backend_agg",
]
"""What the forkserver imports once, so that each worker forked from it starts without
importing torch (~3 s of CPU a process): a fresh interpreter per worker, as 'spawn' gives,
spent most of a multi-process test importing. The server imports only (no torch thread pool
is started), so forking it is safe."""


def run_multiprocess(
    fn: Callable[..., Any],
    out_dir: Path,
    *args: Any,
    world: int = 2,
    timeout: float = 45.0,
) -> list[Any]:
    """Run fn(rank, world, *args) in `world` processes forked from the forkserver (which
    imported FORKSERVER_PRELOAD once) and joined in one gloo group (one CPU thread each);
    return fn's results by rank.

    fn and args must be picklable (a module-level function of a test file is). out_dir must
    be empty or new: it holds the group's file store, each rank's pid, result and traceback,
    and the marker of each rank that finished fn.
    A worker that raises fails the call with its traceback; a hang fails it with TimeoutError
    within `timeout` seconds. Either way the survivors are terminated, then killed, so no
    process outlives the call.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # no-op once the server runs
    ctx = mp.start_processes(
        _worker,
        args=(fn, world, str(out_dir), timeout, args),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                errors = [p.read_text() for p in sorted(out_dir.glob("rank*.err"))]
                raise TimeoutError(
                    f"workers did not finish within {timeout:.0f} s\n" + "\n".join(errors)
                )
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def official_frequencies_buffer(n_neurons: int) -> torch.Tensor:
    """The `attn.freqs` buffer as the official code builds it ([1, 1, 1, N], float32)."""
    i = torch.arange(n_neurons, dtype=torch.float32)
    return (1.0 / (2.0**16) ** ((i / 2).floor() * 2 / n_neurons) / (2 * math.pi)).view(
        1, 1, 1, n_neurons
    )


# ------------------------------------------------------------------ run directories
STREAMING_TBPTT_SETTINGS = [
    "training.block_size=8",
    "training.tbptt_chunk_size=3",
    "training.tbptt_backprop_chunks=2",
    "training.tbptt_persist_across_steps=true",
    "training.min_logical_block_size=32",
    "training.gradient_accumulation_steps=2",
]
"""--set overrides for a streaming TBPTT run: 32-token documents seen as 8-token blocks in
chunks of 3 (two per backward), the state carried across steps, accumulation 2."""

DETERMINISTIC_METRICS = ("step", "tokens", "loss", "lr", "grad_norm", "val_loss", "bits_per_byte")
"""The metrics.jsonl fields that a resumed run must reproduce exactly (no timings)."""


def checkpoint_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a run's latest checkpoint."""
    from safetensors.torch import load_file

    from bdh_train.storage import checkpoint as ckpt

    return load_file(str(ckpt.resolve_checkpoint(run_dir) / ckpt.MODEL_FILE))


def metric_column(run_dir: Path, key: str) -> list[float]:
    """Every value of `key` in metrics.jsonl, in order (rows without it left out)."""
    from bdh_train.train.metrics import read_metrics

    return [r[key] for r in read_metrics(run_dir / "metrics.jsonl") if key in r]


def assert_same_weights(one: Path, other: Path) -> None:
    """The two runs' latest checkpoints hold the same tensors, bit for bit."""
    a, b = checkpoint_weights(one), checkpoint_weights(other)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_same_run(whole: Path, split: Path) -> None:
    """The two runs' latest checkpoints hold bit-identical weights, and their metric rows
    are equal (an uninterrupted run and a resumed one)."""
    assert_same_weights(whole, split)
    assert metric_rows(whole) == metric_rows(split)


def metric_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows with only the deterministic fields."""
    from bdh_train.train.metrics import read_metrics

    return [
        {k: v for k, v in r.items() if k in DETERMINISTIC_METRICS}
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


# ------------------------------------------------------------------ a BPE run's files
BPE_TEXT = "".join(
    f"ROMEO {i}: the quick brown fox — ünïcödé 日本 jumps over {i * i} lazy dogs.\n"
    for i in range(120)
)
"""Small generated text for BPE tests: ASCII, multi-byte characters, digits."""


def bpe_corpus(directory: Path, vocab_size: int = 300):
    """A byte-level BPE trained on `BPE_TEXT`, saved as directory/tokenizer.json, and the text
    encoded with it as directory/text.bin (+ header). Returns (tokenizer, tokenizer.json path,
    .bin path). The .bin stands in for the text as `data.source` with `data.tokenizer`."""
    from bdh_train.data import write_token_file
    from bdh_train.data.tokenizer import train_bpe

    tok = train_bpe([BPE_TEXT], vocab_size)
    directory.mkdir(parents=True, exist_ok=True)
    path = tok.save(directory)
    data = write_token_file(directory / "text.bin", tok.encode(BPE_TEXT), tok.vocab_size)
    return tok, path, data


# ------------------------------------------------------------------ multi-process training
FRESH_BLOCKS = ["training.tbptt_persist_across_steps=false", "training.min_logical_block_size=0"]
"""The tiny preset's streaming turned off: random windows, each block from a fresh state (what
a pipeline needs: a stage keeps no state across steps)."""


DISTRIBUTED_RUN = [
    *FRESH_BLOCKS,
    "model.n_layer=2",
    "model.n_embd=16",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=4",
    "model.dropout=0.0",
    "training.block_size=8",
    "training.batch_size=4",
    "training.log_every=1",
    "training.eval_every=3",
    "training.eval_steps=3",
    "training.checkpoint_every=0",
    "training.max_steps=6",
    "training.gradient_accumulation_steps=2",
]
"""--set overrides of the trainer runs the multi-process tests compare with one process: a
2-layer model without dropout, 4 rows of 8 tokens, accumulation 2, 6 steps, validation at 3
and 6."""


def train_in_group(
    run_dir: Path,
    overrides: list[str],
    rank: int = 0,
    world: int = 1,
    resume: bool = False,
    stop_after: int | None = None,
):
    """Run a Trainer on `overrides` as rank `rank` of a `world`-process group (already joined,
    as `run_multiprocess` does; world 1 is one plain process), quietly; returns it."""
    import io

    from bdh_train.config import load_config
    from bdh_train.distributed.env import DistContext
    from bdh_train.training.trainer import Trainer

    ctx = DistContext(rank, world, rank) if world > 1 else None
    trainer = Trainer(
        load_config(overrides=overrides),
        run_dir,
        resume=resume,
        stream=io.StringIO(),
        dist_ctx=ctx,
    )
    trainer.run(stop_after)
    return trainer


def unequal_count_micro_batches(rows: int = 4, block: int = 6):
    """Two global micro-batches of ids < 32 in which the second half of the rows (the second
    rank's or replica's) counts far fewer targets than the first in the second micro-batch."""
    from bdh_train.batch import IGNORE_INDEX, SequenceBatch

    out = []
    for micro in range(2):
        gen = torch.Generator().manual_seed(10 + micro)
        inputs = torch.randint(0, 32, (rows, block), generator=gen)
        targets = torch.randint(0, 32, (rows, block), generator=gen)
        targets[0, :2] = IGNORE_INDEX
        if micro:
            targets[rows // 2 :, 1:] = IGNORE_INDEX
        out.append(SequenceBatch(inputs, targets))
    return out


# ------------------------------------------------------------------ a process without start-up
@contextlib.contextmanager
def start_process(
    fn: Callable[..., Any],
    *args: Any,
    stdout: Path,
    stderr: Path | None = None,
    file_size_limit: int | None = None,
) -> Iterator[multiprocessing.process.BaseProcess]:
    """fn(*args) started in a process of its own forked from the forkserver
    (FORKSERVER_PRELOAD imported once): a subprocess without an interpreter start and a torch
    import (about 3 s of CPU), with its own pid, signals, locks and exit. Its standard output
    goes to `stdout` (a file, or a named pipe the caller opens for reading), line by line, its
    errors to `stderr` (None: to `stdout` too); it runs as the suite's processes do
    (`_as_a_test_process`), under RLIMIT_FSIZE `file_size_limit` when given. Its `exitcode` is
    fn's return value (a command's exit status), or -N after signal N. Leaving the block kills
    it if it still runs and joins it, so that none outlives a failed test."""
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # no-op once the server runs
    files = (str(stdout), str(stderr if stderr is not None else stdout))
    process = multiprocessing.get_context("forkserver").Process(
        target=_own_process, args=(fn, args, files, file_size_limit)
    )
    process.start()
    try:
        yield process
    finally:
        process.kill()
        process.join()


def _own_process(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    files: tuple[str, str],
    file_size_limit: int | None,
) -> None:
    import resource

    for fd, name in zip((1, 2), files, strict=True):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if file_size_limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    _as_a_test_process()
    sys.exit(fn(*args))


def cli_main(argv: list[str]) -> int:
    """`bdh-train ARGV` (`bdh_train.cli.main`): a command for start_process."""
    from bdh_train.cli import main

    return main(argv)


def cli_as_rank(rank: int, world: int, argv: list[str]) -> int:
    """`bdh-train ARGV` as rank `rank` of a `world`-process group (a run_multiprocess fn):
    with the environment torchrun gives its processes, its console output dropped; main's
    exit status."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    with contextlib.redirect_stdout(io.StringIO()):
        return cli_main(argv)


MICRO_RUN = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=4",
    "training.block_size=16",
    "training.batch_size=4",
]
"""The smallest run the run-directory and checkpoint tests train through the CLI (seconds on
two cores); each adds the length and cadence it needs."""


def set_args(overrides: list[str]) -> list[str]:
    """`--set` arguments of `bdh-train` for `overrides`."""
    return [arg for override in overrides for arg in ("--set", override)]


def entry_digest(path: Path) -> str:
    """What a file-tree entry is, for a before/after comparison: a link as its target, a FIFO
    or directory by kind (never opened), a file by the SHA-256 of its bytes."""
    mode = path.lstat().st_mode
    if stat.S_ISLNK(mode):
        return "-> " + os.readlink(path)
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISDIR(mode):
        return "dir"
    return hashlib.sha256(path.read_bytes()).hexdigest()


MICRO = set_args(
    [*MICRO_RUN, "training.max_steps=3", "training.eval_every=3", "training.checkpoint_every=3"]
)
"""`--set` options of a micro model for the CLI tests (two layers, width 32)."""
