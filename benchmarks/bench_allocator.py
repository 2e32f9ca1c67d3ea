"""Train-step speed and kernel time with the host allocator left as it is ('system') and with
freed memory retained for reuse ('retain', `training.host_allocator`).

Config (a) (L4 D128 H4 multiplier 16, vocab 256, fp32, dropout 0, 2 threads, executor auto)
at T=2048 B=8 by default. The policy is process-wide, so every measurement is a fresh
subprocess; the two modes alternate (system, retain, system, retain, ...) so that load from
other processes falls on both. Each subprocess runs one warm-up step and --steps timed steps
(forward, backward, AdamW) and reports the fastest step, the kernel (sys) and user CPU seconds
and the minor page faults of its timed steps, and its peak RSS.

Run: .venv/bin/python benchmarks/bench_allocator.py [--seq-len 2048 --batch 8 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

from _common import CONFIGS, load_average, machine_line, print_table, timed_train_step

MARKER = "ALLOCATOR_RESULT "


def worker(mode: str, seq_len: int, batch: int, steps: int) -> None:
    import torch

    from bdh_train.model import BDH, BDHConfig
    from bdh_train.train.allocator import configure_host_allocator

    effective = configure_host_allocator(mode, torch.device("cpu"))
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = BDH(BDHConfig(**CONFIGS["a"], vocab_size=256, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (batch, seq_len))
    y = torch.randint(0, 256, (batch, seq_len))

    def step() -> float:
        return timed_train_step(model, optimizer, x, y)

    step()
    before = resource.getrusage(resource.RUSAGE_SELF)
    times = [step() for _ in range(steps)]
    after = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "mode": effective,
        "tok_s": batch * seq_len / min(times),
        "sys_s": (after.ru_stime - before.ru_stime) / steps,
        "user_s": (after.ru_utime - before.ru_utime) / steps,
        "faults": (after.ru_minflt - before.ru_minflt) / steps,
        "peak_mib": after.ru_maxrss / 1024,
    }
    print(MARKER + json.dumps(result), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.seq_len, args.batch, args.steps)
        return
    print(machine_line())
    rows = []
    for round_index in range(args.rounds):
        for mode in ("system", "retain"):
            load = load_average()
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    mode,
                    "--seq-len",
                    str(args.seq_len),
                    "--batch",
                    str(args.batch),
                    "--steps",
                    str(args.steps),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            line = next(x for x in out.splitlines() if x.startswith(MARKER))
            r = json.loads(line[len(MARKER) :])
            rows.append(
                [
                    round_index + 1,
                    r["mode"],
                    f"{r['tok_s']:.0f}",
                    f"{r['user_s']:.1f}",
                    f"{r['sys_s']:.1f}",
                    f"{r['faults']:.0f}",
                    f"{r['peak_mib']:.0f}",
                    f"{load:.2f}",
                ]
            )
    print_table(
        f"config (a) T={args.seq_len} B={args.batch}, fp32, 2 threads, executor auto; "
        "per timed step: user/sys CPU seconds and minor page faults",
        ["round", "allocator", "tokens/s", "user s", "sys s", "faults", "peak MiB", "load"],
        rows,
    )


if __name__ == "__main__":
    main()
