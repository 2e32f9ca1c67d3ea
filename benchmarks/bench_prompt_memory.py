"""Reading a prompt: peak memory against the prompt's length, for every way a prompt reaches
the model.

The model is the 28,672-parameter one of the issue that found prompts' memory growing with
their length ("Trust, round two", item 13): L2 D32 H2 multiplier 4 (N=64), vocab 256, dropout
0, executor "auto", untrained weights; fp32, 1 thread (--threads: on 2 shared CPUs at load
average 6, two threads read 100k tokens in 23 s against 1.4 s for one), random byte prompts.

Entry points (each reads the prompt with `read_tokens`, PREFILL_TOKENS at a time):

* feed: `Continuation.feed`, what `bdh-train chat` and `generate --save-state/--load-state`
  read a prompt with.
* stream: `stream_generate`, what `generate --prompt` and the end-of-run sample read with
  (through `generate`).
* batch: `stream_generate_batch` over 4 rows (the prompt and three 16-token ones), what
  `generate --prompts-file` reads with (through `generate_batch`).
* one call (--one-call): `read_tokens(..., chunk_tokens=None)`, one `forward_hidden` over the
  whole prompt: how every entry point read a prompt before the chunks.

Each case runs in a fresh process (_common.py's method): it builds the model, reads a
16-token primer prompt, builds the prompt's ids as one long tensor (8 bytes a token, the
"ids MiB" column, held by the caller before any reading, as the CLI holds its encoded
prompt), settles and records the RSS baseline, then reads the prompt and draws one token.
delta = peak RSS - baseline: the reading's own memory.

Run: .venv/bin/python benchmarks/bench_prompt_memory.py [--lengths 10000 100000 ...]
    [--one-call-lengths 10000 100000]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from _common import (
    MIB,
    emit,
    load_average,
    machine_line,
    peak_rss_mib,
    print_table,
    run_worker,
    settle_baseline,
    worker_spec,
)

MODEL = dict(n_layer=2, n_embd=32, n_head=2, mlp_internal_dim_multiplier=4, vocab_size=256)
ENTRY_POINTS = ("feed", "stream", "batch")
PRIMER_TOKENS = 16


def worker(spec: dict[str, Any]) -> None:
    import torch

    from bdh_train.generation.continuation import Continuation
    from bdh_train.model import BDH, BDHConfig, sampling
    from bdh_train.model.sampling import read_tokens

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    model = BDH(BDHConfig(**MODEL, dropout=0.0)).eval()
    draws = torch.Generator().manual_seed(1)
    others = [torch.randint(0, 256, (PRIMER_TOKENS,), generator=draws) for _ in range(3)]

    def read(ids: torch.Tensor) -> int:
        how = spec["entry"]
        if how == "feed":
            cont = Continuation(model)
            cont.feed(ids)
            return next(cont.sample(1, temperature=0))
        if how == "stream":
            return int(next(sampling.stream_generate(model, ids, 1, temperature=0))[0])
        if how == "batch":
            return int(
                next(sampling.stream_generate_batch(model, [ids, *others], 1, temperature=0))[0]
            )
        with torch.inference_mode():  # one call
            hidden, _ = read_tokens(model, model.init_state(1), ids.view(1, -1), chunk_tokens=None)
            return int(model.logits_from_hidden(hidden).argmax(-1)[0])

    read(others[0])  # primer: thread pools and kernels exist before the baseline
    ids = torch.randint(0, 256, (spec["tokens"],), generator=draws)
    baseline = settle_baseline()
    started = time.perf_counter()
    read(ids)
    seconds = time.perf_counter() - started
    peak = peak_rss_mib()
    emit(
        {
            "ids_mib": ids.numel() * ids.element_size() / MIB,
            "baseline_mib": baseline,
            "peak_mib": peak,
            "seconds": seconds,
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--lengths", type=int, nargs="+", default=[10_000, 100_000, 1_000_000, 10_000_000]
    )
    ap.add_argument(
        "--one-call-lengths",
        type=int,
        nargs="*",
        default=[10_000, 100_000],
        help="prompt lengths read in one call too (about 5 KB a token: 5 GB at 1M)",
    )
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    args = ap.parse_args()
    print(f"machine: {machine_line()}")
    cases = [(entry, n) for entry in ENTRY_POINTS for n in args.lengths]
    cases += [("one call", n) for n in args.one_call_lengths]
    rows = []
    for entry, tokens in cases:
        spec = {"entry": entry, "tokens": tokens, "threads": args.threads}
        load = load_average()
        r = run_worker(os.path.abspath(__file__), spec, timeout_s=args.timeout_s)
        if "error" in r:
            rows.append((entry, f"{tokens:,}", "-", "-", "-", "-", "-", r["error"], f"{load:.2f}"))
            continue
        delta = r["peak_mib"] - r["baseline_mib"]
        rows.append(
            (
                entry,
                f"{tokens:,}",
                f"{r['ids_mib']:.1f}",
                f"{r['peak_mib']:.0f}",
                f"{delta:.1f}",
                f"{delta * MIB / tokens:.1f}",
                f"{r['seconds']:.1f}",
                f"{tokens / r['seconds']:,.0f}",
                f"{load:.2f}",
            )
        )
    print_table(
        "Reading a prompt, 28,672-parameter model (L2 D32 H2 x4, vocab 256), fp32, "
        f"{args.threads} thread{'s' if args.threads > 1 else ''}: ids MiB = the prompt's ids "
        "(held before the baseline); delta = peak RSS - RSS with the model and the ids; "
        "B/token = delta / tokens",
        (
            "entry point",
            "tokens",
            "ids MiB",
            "peak MiB",
            "delta MiB",
            "B/token",
            "s",
            "tokens/s",
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
