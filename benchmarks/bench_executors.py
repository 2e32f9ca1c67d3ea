"""Train-step speed and peak memory of the mixer's executors against the naive masked form.

For each config, sequence length T and executor, one fresh subprocess builds the model (fp32,
dropout 0, vocab 256, 2 threads), an AdamW optimizer and a random batch of 8 rows, then runs
1 warm-up train step (LanguageTrainModel.train_step + AdamW step) and at least 2 timed ones
(short steps repeat until 8 s of timed steps or 5 steps; only 1 if the warm-up took more than
60 s). tokens/s = B*T / fastest timed step (other processes share the 2 cores and only ever
slow a step down; the median is printed too). Peak memory: see _common.py (lifetime peak RSS
of the fresh process, and that peak minus the RSS right after setup).

Executors: "naive" is the official implementation's plain masked dense form,
    scores = q @ q.transpose(-1, -2); scores = scores.tril(diagonal=-1); out = scores @ v
patched in as mixer's "dense" executor inside its own subprocess, so everything else (rope,
norms, projections, loss, optimizer) is the same code; "dense" is mixer.dense_attention
(in-place tril_), "chunked/C" is mixer.chunked_attention with chunk C, and "auto" is whatever
mixer.choose_executor picks with BDHConfig's default chunk_size (256 since commit e6a9e98,
64 before; read at run time, so "auto" always means the repo's default). auto's choice is
resolved in the parent: when it is a run already in the table, that run's figures are
repeated (the code path is identical), marked "= <executor>". "chunked-split/C" is a
diagnostic variant, not in the default grid: chunked_attention with the chunks cut by
torch.split (see split_chunked_attention). Any name may end in "@B" to run at batch B.

Other processes on the machine slow a 2-thread step badly, so every run reports "others %"
(the CPU share other processes used during its timed steps); --wait-quiet S waits for a quiet
machine before each run and --retry-disturbed K measures a disturbed run (> 10%) again.

Before each run the step's memory and time are ESTIMATED (saved activations measured with
saved_tensors_hooks: per layer 4 [B,H,T,N] tensors + the T x T scores (dense) or the chunk
scores and one [B,H,N,D] state per chunk (chunked); time from a multiply-add count and the
machine's measured matmul throughput). Runs estimated above --max-gib or --max-step-s are
skipped and printed as such instead of being started.

Run:  .venv/bin/python benchmarks/bench_executors.py --wait-quiet 600 --retry-disturbed 2
                                      # the full grid: ~23 min of measuring on 2 quiet cores
      .venv/bin/python benchmarks/bench_executors.py --quick    # smoke run, config a, T<=512
      .venv/bin/python benchmarks/bench_executors.py --configs a --lengths 1024,2048
      .venv/bin/python benchmarks/bench_executors.py --dry-run  # the plan and its estimates
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
from typing import Any

from _common import (
    CONFIGS,
    GIB,
    cpu_counters,
    emit,
    fmt,
    load_average,
    machine_line,
    matmul_gflops,
    others_cpu_share,
    peak_rss_mib,
    print_table,
    run_worker,
    settle_baseline,
    wait_for_quiet,
    worker_spec,
)

from bdh_train.model import BDHConfig
from bdh_train.model.mixer import calibration_for

CHUNKS = (64, 128, 256, 512)
BATCH = 8
THREADS = 2
AUTO_CHUNK = BDHConfig().chunk_size or calibration_for("cpu").chunk_size  # what "auto" chunks with
WARMUP_LONG_S = 60.0  # a warm-up step longer than this leaves one timed step
PRIMER_TOKENS = 16  # a setup step this long precedes the RSS baseline
DISTURBED = 0.10  # others' CPU share above which a run counts as disturbed (--retry-disturbed)
MIN_TIMED_S = 8.0  # short steps are repeated until this much timed time ...
MAX_TIMED_STEPS = 5  # ... or this many timed steps
# The default grid: what fits the ~25 minute budget on 2 cores (see docs/benchmarks-history.md,
# "What was not measured, and why", for what a first, wider run measured and why these runs
# were kept). "name@B" runs at batch B instead of BATCH and is compared with "naive@B": it
# stands in for a batch-8 run the memory guard skips (a, T=4096: naive ~19 GiB; b, T>=2048:
# every executor keeps 4 [B,H,T,N] tensors per layer, ~19-28 GiB). "auto" costs no run when
# its choice is already listed.
DEFAULT_GRID: dict[str, dict[int, tuple[str, ...]]] = {
    "a": {
        256: ("naive", "dense", "chunked/128", "auto"),
        512: ("naive", "dense", "chunked/64", "chunked/128", "chunked/256", "auto"),
        1024: ("naive", "dense", "chunked/64", "chunked/128", "chunked/256", "auto"),
        2048: ("naive", "chunked/64", "chunked/256", "chunked/512", "auto"),
        4096: (
            "naive",
            "chunked/64",
            "chunked/256",
            "auto",
            "naive@4",
            "chunked/256@4",
            "auto@4",
        ),
    },
    "b": {
        256: ("naive", "dense", "auto"),
        512: ("naive", "dense", "chunked/256", "auto"),
        2048: (
            "naive",
            "chunked/256",
            "auto",
            "naive@2",
            "chunked/64@2",
            "chunked/256@2",
            "chunked/512@2",
            "auto@2",
        ),
        4096: ("naive", "chunked/256", "auto"),
    },
}


def parse_executor(name: str) -> tuple[str, int, int]:
    """'naive' | 'dense' | 'chunked/C' | 'auto', optionally '@B' -> (executor, chunk, batch)."""
    name, _, batch = name.partition("@")
    batch_size = int(batch) if batch else BATCH
    if name.startswith(("chunked/", "chunked-split/")):
        kind, chunk = name.split("/", 1)
        return kind, int(chunk), batch_size
    if name in ("naive", "dense", "auto"):
        return name, AUTO_CHUNK, batch_size
    raise ValueError(f"unknown executor {name!r}")


def batch_suffix(name: str) -> str:
    """'@B' of a run name, or ''."""
    return name[name.index("@") :] if "@" in name else ""


def model_dims(config: str) -> tuple[int, int, int, int]:
    """(L, D, H, N) of a named config."""
    c = CONFIGS[config]
    n = c["mlp_internal_dim_multiplier"] * c["n_embd"] // c["n_head"]
    return c["n_layer"], c["n_embd"], c["n_head"], n


def resolve_auto(config: str, seq_len: int, suffix: str = "") -> str:
    """The run name mixer.choose_executor picks for "auto" (with the same batch suffix)."""
    from bdh_train.model.mixer import choose_executor

    _, d, _, n = model_dims(config)
    cpu = calibration_for("cpu")
    choice = choose_executor(seq_len, n, d, AUTO_CHUNK, cpu.chunked_margin, cpu.dense_panel_rows)
    return ("dense" if choice == "dense" else f"chunked/{AUTO_CHUNK}") + suffix


# --------------------------------------------------------------------- estimates
def estimate_bytes(config: str, seq_len: int, name: str) -> float:
    """Peak memory of one train step, from the saved-tensor inventory plus transients."""
    layers, d, h, n = model_dims(config)
    ex, chunk, batch = parse_executor(name)
    if ex == "auto":
        ex, chunk, batch = parse_executor(resolve_auto(config, seq_len, batch_suffix(name)))
    unit = batch * h * seq_len * n * 4  # one [B, H, T, N] fp32 tensor
    weights = 2 * batch * h * d * n * 4  # encoder/encoder_v broadcast to the batch (saved)
    per_layer = 4 * unit + weights
    # forward temporaries, then the gradients in flight in backward (a chunk's slice of q
    # gets a full-size gradient buffer in backward: two more for chunked)
    transient = 4 * unit
    if ex in ("dense", "naive"):
        scores = batch * h * seq_len * seq_len * 4
        per_layer += scores
        transient += (3 if ex == "naive" else 2) * scores
    else:
        chunks = math.ceil(seq_len / chunk)
        per_layer += batch * h * seq_len * chunk * 4 + (chunks - 1) * batch * h * n * d * 4
        transient += 2 * unit + 4 * batch * h * chunk * chunk * 4
    return layers * per_layer + transient + 2 * unit / h  # + rope cos/sin


def estimate_macs(config: str, seq_len: int, name: str) -> float:
    """Multiply-adds of one train step (forward x3 for forward + backward)."""
    layers, d, h, n = model_dims(config)
    ex, chunk, batch = parse_executor(name)
    if ex == "auto":
        ex, chunk, batch = parse_executor(resolve_auto(config, seq_len, batch_suffix(name)))
    per_token = 3 * h * d * n  # encoder, encoder_v, decoder
    if ex in ("dense", "naive"):
        per_token += h * seq_len * (n + d)
    else:
        per_token += h * min(chunk, seq_len) * (n + d) + 2 * h * n * d
    return 3 * layers * batch * seq_len * per_token


# --------------------------------------------------------------------- worker
def naive_dense_attention(
    q, v, *, initial_state=None, log_decay=None, chunk_size=None, output_final_state=True
):
    """The official implementation's masked dense form (no state, no decay: full backprop)."""
    if initial_state is not None or log_decay is not None or output_final_state:
        raise RuntimeError("the naive baseline covers stateless full-sequence training only")
    scores = q @ q.transpose(-1, -2)
    scores = scores.tril(diagonal=-1)
    return scores @ v, None


def split_chunked_attention(
    q, v, *, initial_state=None, log_decay=None, chunk_size=64, output_final_state=True
):
    """mixer.chunked_attention with its chunks cut by torch.split instead of slicing.

    A diagnostic variant ("chunked-split/C"), not the repo's executor: the same chunk loop
    and per-chunk dense_attention, but split's backward concatenates the chunk gradients
    once, where one slice per chunk makes autograd build a full [B,H,T,N] gradient per chunk
    (O(T^2 / C) memory traffic and page faults in backward).
    """
    import torch

    from bdh_train.model import mixer

    rho = initial_state
    q_chunks = torch.split(q, chunk_size, dim=2)
    v_chunks = torch.split(v, chunk_size, dim=2)
    outs = []
    for i, (q_c, v_c) in enumerate(zip(q_chunks, v_chunks, strict=True)):
        last = i == len(q_chunks) - 1
        out, rho = mixer.dense_attention(
            q_c,
            v_c,
            initial_state=rho,
            log_decay=log_decay,
            output_final_state=output_final_state or not last,
        )
        outs.append(out)
    return torch.cat(outs, dim=2), rho


def worker(spec: dict[str, Any]) -> None:
    import torch

    from bdh_train.batch import SequenceBatch
    from bdh_train.model import BDH, BDHConfig, mixer
    from bdh_train.train.step import LanguageTrainModel

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    ex, chunk, batch_size = parse_executor(spec["executor"])
    if ex == "naive":
        mixer.EXECUTOR_FUNCTIONS["dense"] = naive_dense_attention
        ex = "dense"
    elif ex == "chunked-split":
        mixer.EXECUTOR_FUNCTIONS["chunked"] = split_chunked_attention
        ex = "chunked"
    config = BDHConfig(
        **CONFIGS[spec["config"]], vocab_size=256, dropout=0.0, executor=ex, chunk_size=chunk
    )
    model = BDH(config)
    train = LanguageTrainModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (batch_size, spec["seq_len"] + 1), generator=g)
    batch = SequenceBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def step(b: SequenceBatch = batch) -> float:
        started = time.perf_counter()
        train.train_step(b)
        optimizer.step()
        return time.perf_counter() - started

    step(batch.time_slice(0, PRIMER_TOKENS))  # thread pools, kernels, AdamW state: setup
    base = settle_baseline()
    warm = step()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    counters = cpu_counters()
    timed = [step()]
    if warm <= WARMUP_LONG_S:
        # at least timed_steps; short steps repeat up to MIN_TIMED_S (other processes share
        # the cores, and the fastest step is the one least disturbed by them)
        while len(timed) < spec["timed_steps"] or (
            sum(timed) < MIN_TIMED_S and len(timed) < MAX_TIMED_STEPS
        ):
            timed.append(step())
    peak = peak_rss_mib()
    after = resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - usage.ru_utime, after.ru_stime - usage.ru_stime
    emit(
        {
            "warmup_s": warm,
            "step_s": timed,
            "base_mib": base,
            "peak_mib": peak,
            "sys_frac": system / max(user + system, 1e-9),
            "others": others_cpu_share(counters, cpu_counters()),
        }
    )


# --------------------------------------------------------------------- parent
def measure(config: str, seq_len: int, name: str, args, rate_gflops: float) -> dict[str, Any]:
    est_gib = estimate_bytes(config, seq_len, name) / GIB
    est_s = 2 * estimate_macs(config, seq_len, name) / (rate_gflops * 1e9)
    row: dict[str, Any] = {"est_gib": est_gib, "est_s": est_s}
    if est_gib > args.max_gib:
        row["skip"] = f"skipped (estimated {est_gib:.1f} GiB)"
    elif est_s > args.max_step_s:
        row["skip"] = f"skipped (estimated {est_s / 60:.1f} min/step)"
    elif args.dry_run:
        row["skip"] = "dry run"
    if "skip" in row:
        row["load"] = load_average()
        return row
    spec = {
        "config": config,
        "seq_len": seq_len,
        "executor": name,
        "threads": THREADS,
        "timed_steps": args.timed_steps,
    }
    best: dict[str, Any] | None = None
    for attempt in range(1 + args.retry_disturbed):
        if args.wait_quiet > 0:
            wait_for_quiet(args.wait_quiet)
        result = dict(row, load=load_average(), attempts=attempt + 1)
        result.update(run_worker(os.path.abspath(__file__), spec, timeout_s=args.timeout_s))
        if "step_s" not in result:
            return result
        if best is None or result["others"] < best["others"]:
            best = result
        if result["others"] <= DISTURBED or attempt == args.retry_disturbed:
            break
        print(
            f"    ({config}) T={seq_len} {name}: others used {100 * result['others']:.0f}% of "
            "the CPUs during the timed steps; measuring again",
            file=sys.stderr,
            flush=True,
        )
    assert best is not None
    batch = parse_executor(name)[2]
    # contention from other processes only ever slows a step: rank by the fastest one
    best["tok_s"] = batch * seq_len / min(best["step_s"])
    best["tok_s_median"] = batch * seq_len / statistics.median(best["step_s"])
    best["delta_mib"] = best["peak_mib"] - best["base_mib"]
    return best


def report(config: str, results: dict[tuple[int, str], dict[str, Any]]) -> None:
    layers, d, h, n = model_dims(config)
    title = (
        f"config ({config}): L{layers} D{d} H{h} N{n}, fp32, {THREADS} threads. tokens/s: "
        "train step (fwd + bwd + AdamW) from the fastest timed step (median in brackets); "
        "steps: warm-up + timed; memory: peak RSS of the fresh process and delta = peak - RSS "
        "after setup; ratios against naive at the same T and batch (speed: tokens/s ratio, "
        "memory: delta ratio); sys %: kernel share of the timed steps' CPU time (page "
        "faults of freshly mapped activations); others %: CPU capacity other processes used "
        "during the timed steps (0 = undisturbed); load: 1-min load average at the start"
    )
    headers = (
        "T",
        "B",
        "executor",
        "tokens/s",
        "steps",
        "peak MiB",
        "delta MiB",
        "est GiB",
        "speed vs naive",
        "mem vs naive",
        "sys %",
        "others %",
        "load",
    )
    rows = []
    for (seq_len, name), r in results.items():
        base, _, _ = name.partition("@")
        batch = parse_executor(name)[2]
        label = f"auto (= {r['resolved'].partition('@')[0]})" if base == "auto" else base
        if "skip" in r or "error" in r:
            note = r.get("skip") or r.get("error")
            est = f"{r['est_gib']:.1f}"
            load = f"{r['load']:.2f}"
            rows.append((seq_len, batch, label, note, "", "", "", est, "", "", "", "", load))
            continue
        naive = results.get((seq_len, "naive" + batch_suffix(name)), {})
        speed = mem = None
        if "tok_s" in naive:
            speed = r["tok_s"] / naive["tok_s"]
            mem = r["delta_mib"] / naive["delta_mib"]
        rows.append(
            (
                seq_len,
                batch,
                label,
                f"{r['tok_s']:.0f} ({r['tok_s_median']:.0f})",
                f"1+{len(r['step_s'])}",
                f"{r['peak_mib']:.0f}",
                f"{r['delta_mib']:.0f}",
                f"{r['est_gib']:.1f}",
                "-" if speed is None else f"{speed:.2f}x",
                fmt(mem, ".2f"),
                f"{100 * r['sys_frac']:.0f}",
                f"{100 * r['others']:.0f}",
                f"{r['load']:.2f}",
            )
        )
    print_table(title, headers, rows)


def summarize(config: str, results: dict[tuple[int, str], dict[str, Any]]) -> None:
    """Best executor per (T, batch) against naive: the acceptance targets' view."""
    print(f"\nconfig ({config}) best executor per T and batch (by tokens/s; naive excluded):")
    groups = sorted({(t, batch_suffix(name)) for t, name in results})
    for seq_len, suffix in groups:
        batch = parse_executor("naive" + suffix)[2]
        naive = results.get((seq_len, "naive" + suffix), {})
        runs = [
            (r["tok_s"], name.partition("@")[0], r)
            for (t, name), r in results.items()
            if t == seq_len and batch_suffix(name) == suffix and "tok_s" in r
            if not name.startswith("naive")
        ]
        where = f"T={seq_len} B={batch}"
        if not runs:
            print(f"  {where}: nothing measured besides naive")
            continue
        tok_s, name, r = max(runs, key=lambda x: x[0])
        small = min(runs, key=lambda x: x[2]["delta_mib"])
        if "tok_s" in naive:
            nd = naive["delta_mib"]
            print(
                f"  {where}: fastest {name} {tok_s:.0f} tok/s = {tok_s / naive['tok_s']:.2f}x "
                f"naive, memory {r['delta_mib'] / nd:.2f} of naive; smallest memory "
                f"{small[1]} {small[2]['delta_mib'] / nd:.2f} of naive at "
                f"{small[0] / naive['tok_s']:.2f}x speed"
            )
        else:
            print(f"  {where}: fastest {name} {tok_s:.0f} tok/s (naive not measured)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="config a, T in {256, 512} only")
    ap.add_argument("--configs", default="a,b", help="comma list of a,b")
    ap.add_argument("--lengths", default=None, help="comma list of T (default: the grid's)")
    ap.add_argument(
        "--executors",
        default=None,
        help="comma list of naive, dense, chunked/C, auto (each optionally @B for batch B) "
        "and the diagnostic chunked-split/C; default: the built-in grid per T",
    )
    ap.add_argument("--timed-steps", type=int, default=2)
    ap.add_argument("--max-gib", type=float, default=18.0, help="skip runs estimated above")
    ap.add_argument("--max-step-s", type=float, default=180.0, help="skip runs estimated above")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per subprocess")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its estimates")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each run wait up to S seconds for other processes to leave the CPUs",
    )
    ap.add_argument(
        "--retry-disturbed",
        type=int,
        default=0,
        metavar="K",
        help="measure a run again, up to K times, while other processes used more than "
        f"{100 * DISTURBED:.0f}%% of the CPUs during its timed steps; the least disturbed "
        "one is kept",
    )
    args = ap.parse_args()
    configs = ["a"] if args.quick else args.configs.split(",")
    if args.quick:
        lengths = [256, 512]
    elif args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    else:
        lengths = None  # each config's grid
    rate = matmul_gflops(THREADS)
    print(f"machine: {machine_line()}")
    print(f"matmul throughput now: {rate:.0f} GFLOP/s (time estimates use it)")
    started = time.perf_counter()
    for config in configs:
        results: dict[tuple[int, str], dict[str, Any]] = {}
        for seq_len in lengths or sorted(DEFAULT_GRID[config]):
            if args.executors:
                names = args.executors.split(",")
            else:
                all_names = ("naive", "dense", *(f"chunked/{c}" for c in CHUNKS), "auto")
                names = DEFAULT_GRID[config].get(seq_len, all_names)
            for name in names:
                if name.startswith("chunked") and parse_executor(name)[1] >= seq_len:
                    continue  # one chunk: the dense computation plus state overhead
                if name.partition("@")[0] == "auto":
                    resolved = resolve_auto(config, seq_len, batch_suffix(name))
                    if (seq_len, resolved) in results and "skip" not in results[
                        (seq_len, resolved)
                    ]:
                        results[(seq_len, name)] = dict(results[(seq_len, resolved)])
                    else:
                        results[(seq_len, name)] = measure(config, seq_len, resolved, args, rate)
                    results[(seq_len, name)]["resolved"] = resolved
                else:
                    results[(seq_len, name)] = measure(config, seq_len, name, args, rate)
                r = results[(seq_len, name)]
                status = r.get("skip") or r.get("error")
                if status is None:
                    steps = ", ".join(f"{x:.2f}" for x in [r["warmup_s"], *r["step_s"]])
                    status = (
                        f"{r['tok_s']:.0f} tok/s, peak {r['peak_mib']:.0f} MiB, delta "
                        f"{r['delta_mib']:.0f} MiB, steps (warm-up first) {steps} s, "
                        f"sys {100 * r['sys_frac']:.0f}%, others {100 * r['others']:.0f}%"
                    )
                print(
                    f"[{time.perf_counter() - started:6.0f} s] ({config}) T={seq_len} {name}: "
                    f"{status} (est {r['est_gib']:.1f} GiB, {r['est_s']:.0f} s/step, "
                    f"load {r['load']:.2f})",
                    file=sys.stderr,
                    flush=True,
                )
        report(config, results)
        summarize(config, results)
    print(f"\ntotal wall time {(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    _spec = worker_spec()
    if _spec is not None:
        worker(_spec)
    else:
        main()
