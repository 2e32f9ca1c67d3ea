"""TBPTT: a train step's peak activation memory follows the chunk c, not the block length T.

Config (a) (L4 D128 H4 multiplier 16, N=512, vocab 256, dropout 0, executor "auto" with the
default chunk_size; the table names what auto ran for each backward window), fp32,
2 threads, batch 2. Each case is a LanguageTrainModel train step + AdamW step on a random
block of T tokens, either with full backprop through the block (tbptt_chunk_size=0) or with
TBPTT chunks of c tokens (tbptt_backprop_chunks=1: forward and backward of one chunk, then
the state is detached and carried to the next chunk). One fresh subprocess per case: 1
warm-up step + at least 2 timed steps (repeated up to 8 s); memory = peak RSS of the process
and delta = peak - RSS after setup (see _common.py). tokens/s from the fastest timed step.

"est act MiB" is the activation estimate of one backward window: the window length
w = c (TBPTT) or T (full) times L * 4 saved [B,H,w,N] fp32 tensors per token plus temporaries
(bench_executors.estimate_bytes, which counts the chunked executor's per-chunk states too).

Run: .venv/bin/python benchmarks/bench_tbptt_memory.py [--batch 2]
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
# (T, c): c = 0 is full backprop through the block
CASES = ((4096, 0), (4096, 1024), (4096, 512), (4096, 256), (2048, 0), (2048, 256), (1024, 256))
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
    chunk = spec["chunk"]
    train = LanguageTrainModel(model, tbptt_chunk_size=chunk, tbptt_backprop_chunks=1)
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
    warm = step()
    counters = cpu_counters()
    timed = [step()]
    while len(timed) < 2 or (sum(timed) < MIN_TIMED_S and len(timed) < MAX_TIMED_STEPS):
        timed.append(step())
    window = chunk if 0 < chunk < spec["seq_len"] else spec["seq_len"]
    executor, chunk_size = resolve_executor(
        config.executor, window, config.n_neurons, config.n_embd, config.chunk_size, "cpu"
    )
    if executor == "chunked":
        executor = f"chunked/{chunk_size}"
    emit(
        {
            "warmup_s": warm,
            "step_s": timed,
            "base_mib": base,
            "peak_mib": peak_rss_mib(),
            "executor": executor,
            "others": others_cpu_share(counters, cpu_counters()),
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each case wait up to S seconds for other processes to leave the CPUs",
    )
    args = ap.parse_args()
    from bench_executors import estimate_bytes

    print(f"machine: {machine_line()}")
    rows = []
    full: dict[int, float] = {}
    for seq_len, chunk in CASES:
        if args.wait_quiet > 0:
            wait_for_quiet(args.wait_quiet)
        load = load_average()
        spec = {"seq_len": seq_len, "chunk": chunk, "batch": args.batch, "threads": args.threads}
        r = run_worker(os.path.abspath(__file__), spec, timeout_s=args.timeout_s)
        window = chunk or seq_len
        # the executor "auto" picks for the window, as bench_executors names it
        est_name = f"{r.get('executor', 'dense')}@{args.batch}"
        est = estimate_bytes("a", window, est_name) / MIB
        label = "full" if chunk == 0 else str(chunk)
        if "error" in r:
            rows.append(
                (seq_len, label, r["error"], "", "", "", f"{est:.0f}", "", "", f"{load:.2f}")
            )
            print(f"T={seq_len} c={label}: {r['error']}", flush=True)
            continue
        delta = r["peak_mib"] - r["base_mib"]
        if chunk == 0:
            full[seq_len] = delta
        tok_s = args.batch * seq_len / min(r["step_s"])
        tok_med = args.batch * seq_len / statistics.median(r["step_s"])
        steps = ", ".join(f"{x:.2f}" for x in [r["warmup_s"], *r["step_s"]])
        print(f"T={seq_len} c={label}: delta {delta:.0f} MiB, steps {steps} s", flush=True)
        vs_full = f"{delta / full[seq_len]:.2f}" if seq_len in full else "-"
        rows.append(
            (
                seq_len,
                label,
                r["executor"],
                f"{tok_s:.0f} ({tok_med:.0f})",
                f"{r['peak_mib']:.0f}",
                f"{delta:.0f}",
                f"{est:.0f}",
                vs_full,
                f"{100 * r['others']:.0f}",
                f"{load:.2f}",
            )
        )
    print_table(
        f"TBPTT memory, config (a), batch {args.batch}, fp32, {args.threads} threads, "
        "tbptt_backprop_chunks=1. tokens/s from the fastest timed step (median in brackets); "
        "delta = peak RSS - RSS after setup; vs full: delta / full-backprop delta at the same T; "
        "others %: CPU capacity other processes used during the timed steps",
        (
            "T",
            "chunk c",
            "executor per window",
            "tokens/s",
            "peak MiB",
            "delta MiB",
            "est act MiB",
            "vs full",
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
