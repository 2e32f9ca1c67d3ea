"""Recomputation: train-step speed and memory of training.recompute = none / layer / mixer.

Config (a) (L4 D128 H4 multiplier 16, N=512, vocab 256, dropout 0, executor "auto" with the
default chunk_size; the table names what auto ran), fp32, 2 threads, batch 8, full backprop
through the block (no TBPTT). Each case is a LanguageTrainModel train step + AdamW step on a
random block of T tokens with `BDH.set_recompute(mode)`. One fresh subprocess per case: 1
warm-up step + at least 2 timed steps (repeated up to 8 s); memory = peak RSS of the process
and delta = peak - RSS after setup (see _common.py). tokens/s from the fastest timed step.

"saved MiB" is exact and free of allocator noise: the bytes autograd keeps for backward in one
training forward of the block (distinct storages, the weights left out), counted by a
saved-tensor hook after the timed steps. Inside a recomputed region the checkpoint's own hooks
take the tensors instead, so the count leaves out what the checkpoints hold: each call's
inputs ('layer': u [B, 1, T, D], 8 MiB per layer at T=2048, B=8; 'mixer': x and u, which
the layer keeps anyway).

With --memory-only each case runs the warm-up step alone (its peak is the timed steps' too:
the same work), for a machine too busy for timings; tokens/s then comes from that one step.

Run: .venv/bin/python benchmarks/bench_recompute.py [--seq-lens 512 2048] [--batch 8]
     [--memory-only] [--wait-quiet S]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from _common import (
    CONFIGS,
    MIB,
    cpu_counters,
    emit,
    load_average,
    machine_line,
    others_cpu_share,
    peak_rss_mib,
    print_table,
    run_worker,
    settle_baseline,
    wait_for_quiet,
    worker_spec,
)

CONFIG_A = CONFIGS["a"]
MODES = ("none", "layer", "mixer")
PRIMER_TOKENS = 16
MIN_TIMED_S = 8.0
MAX_TIMED_STEPS = 5


def worker(spec: dict[str, Any]) -> None:
    import torch

    from bdh_train.batch import SequenceBatch
    from bdh_train.model import BDH, BDHConfig
    from bdh_train.model.mixer import resolve_executor
    from bdh_train.train.step import LanguageTrainModel

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    config = BDHConfig(**CONFIG_A, vocab_size=256, dropout=0.0)
    model = BDH(config)
    model.set_recompute(spec["mode"])
    train = LanguageTrainModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (spec["batch"], spec["seq_len"] + 1), generator=g)
    batch = SequenceBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def step(b: SequenceBatch = batch) -> float:
        started = time.perf_counter()
        train.train_step(b)
        optimizer.step()
        return time.perf_counter() - started

    step(batch.time_slice(0, PRIMER_TOKENS))
    base = settle_baseline()
    counters = cpu_counters()
    warm = step()
    timed = []
    if not spec["memory_only"]:  # the timed steps repeat the warm-up's work: same peak
        counters = cpu_counters()
        timed.append(step())
        while len(timed) < 2 or (sum(timed) < MIN_TIMED_S and len(timed) < MAX_TIMED_STEPS):
            timed.append(step())
    others = others_cpu_share(counters, cpu_counters())
    peak = peak_rss_mib()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}  # storage -> bytes: a tensor saved twice is held once

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.train()
        model.loss_from_hidden(model.forward_hidden(batch.inputs), batch.targets)
    executor, chunk_size = resolve_executor(
        config.executor,
        spec["seq_len"],
        config.n_neurons,
        config.n_embd,
        config.chunk_size,
        "cpu",
    )
    if executor == "chunked":
        executor = f"chunked/{chunk_size}"
    emit(
        {
            "warmup_s": warm,
            "step_s": timed,
            "base_mib": base,
            "peak_mib": peak,
            "saved_mib": sum(saved.values()) / MIB,
            "executor": executor,
            "others": others,
        }
    )


def _ratio(value: float, reference: dict[str, float], key: str) -> str:
    """value / the 'none' case's figure at the same T ('-' without one)."""
    return f"{value / reference[key]:.2f}" if reference else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument(
        "--memory-only",
        action="store_true",
        help="one step per case, no timed steps: memory figures only (on a busy machine)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each case wait up to S seconds for other processes to leave the CPUs",
    )
    args = ap.parse_args()
    print(f"machine: {machine_line()}")
    rows = []
    for seq_len in args.seq_lens:
        reference: dict[str, float] = {}
        for mode in MODES:
            if args.wait_quiet > 0:
                wait_for_quiet(args.wait_quiet)
            load = load_average()
            spec = {
                "seq_len": seq_len,
                "mode": mode,
                "batch": args.batch,
                "threads": args.threads,
                "memory_only": args.memory_only,
            }
            r = run_worker(os.path.abspath(__file__), spec, timeout_s=args.timeout_s)
            if "error" in r:
                rows.append((seq_len, mode, r["error"], "", "", "", "", "", "", "", "", ""))
                print(f"T={seq_len} {mode}: {r['error']}", flush=True)
                continue
            delta = r["peak_mib"] - r["base_mib"]
            tokens = args.batch * seq_len
            if r["step_s"]:
                tok_s = tokens / min(r["step_s"])
                speed = f"{tok_s:.0f} ({tokens / statistics.median(r['step_s']):.0f})"
            else:
                tok_s = tokens / r["warmup_s"]
                speed = f"- ({tok_s:.0f})"
            if mode == "none":
                reference = {"tok_s": tok_s, "delta": delta, "saved": r["saved_mib"]}
            steps = ", ".join(f"{x:.2f}" for x in [r["warmup_s"], *r["step_s"]])
            print(f"T={seq_len} {mode}: delta {delta:.0f} MiB, steps {steps} s", flush=True)
            rows.append(
                (
                    seq_len,
                    mode,
                    r["executor"],
                    speed,
                    _ratio(tok_s, reference, "tok_s"),
                    f"{r['peak_mib']:.0f}",
                    f"{delta:.0f}",
                    _ratio(delta, reference, "delta"),
                    f"{r['saved_mib']:.0f}",
                    _ratio(r["saved_mib"], reference, "saved"),
                    f"{100 * r['others']:.0f}",
                    f"{load:.2f}",
                )
            )
    print_table(
        f"recompute, config (a), batch {args.batch}, fp32, {args.threads} threads, full "
        "backprop, executor auto. tokens/s from the fastest timed step (median in brackets; "
        "with --memory-only only the warm-up step's, in brackets); "
        "delta = peak RSS - RSS after setup; saved = bytes autograd keeps for backward outside "
        "recomputed regions in one forward (weights excluded); 'vs none' ratios at the same T; "
        "others %: CPU capacity other processes used during the timed steps (the warm-up with "
        "--memory-only); load: 1-min load average at the start",
        (
            "T",
            "recompute",
            "executor",
            "tokens/s",
            "speed vs none",
            "peak MiB",
            "delta MiB",
            "delta vs none",
            "saved MiB",
            "saved vs none",
            "others %",
            "load",
        ),
        rows,
    )


if __name__ == "__main__":
    _spec = worker_spec()
    if _spec is not None:
        worker(_spec)
    else:
        main()
