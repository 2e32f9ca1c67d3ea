"""`bdh-train inspect --prompts`: the whole command's peak memory against the prompt's length.

The run is the issue's small model (L2 D32 H2 multiplier 4, vocab 256, byte tokenizer),
trained 2 steps on the bundled text into a temporary directory. The prompts file holds one
line, {"prompt": TEXT}, TEXT random lowercase letters and spaces of each given length (one
token a character). Each row runs `inspect --checkpoint RUN --prompts FILE --max-tokens 300
--device cpu --out OUT` in a fresh process (`bdh_train.cli.main`, 1 thread) and reports the
process's peak RSS (VmHWM, so the imports, the model and the file's text, JSON and ids all
count), the command's exit status and its seconds.

The code measured is whatever `bdh_train` the interpreter imports (PYTHONPATH), so the same
script measures a checkout before and after a change.

Run: PYTHONPATH=src .venv/bin/python benchmarks/bench_inspect_prompts.py [--chars 1000000 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit, load_average, machine_line, peak_rss_mib, print_table, run_worker

RUN = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=4",
    "training.max_steps=2",
    "training.block_size=32",
    "training.batch_size=2",
    "training.eval_activity=false",
]


def worker(spec: dict[str, Any]) -> None:
    import torch

    from bdh_train.cli import main

    torch.set_num_threads(1)
    argv = ["inspect", "--checkpoint", spec["run"], "--prompts", spec["prompts"]]
    argv += ["--max-tokens", "300", "--device", "cpu", "--out", spec["out"]]
    started = time.perf_counter()
    status = main(argv)
    emit({"status": status, "seconds": time.perf_counter() - started, "peak_mib": peak_rss_mib()})


def _prompts_file(path: Path, chars: int) -> None:
    draw = random.Random(chars)
    text = "".join(draw.choice("abcdefghijklmnopqrstuvwxyz    ") for _ in range(chars))
    path.write_text(json.dumps({"prompt": text}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chars", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    args = ap.parse_args()
    print(f"machine: {machine_line()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-inspect-") as tmp:
        base = Path(tmp)
        train = run_worker(
            os.path.abspath(__file__),
            {"train": str(base / "run"), "threads": 1},
            timeout_s=args.timeout_s,
        )
        if train.get("status") != 0:
            raise SystemExit(f"training the run failed: {train}")
        for chars in args.chars:
            prompts = base / f"prompts-{chars}.jsonl"
            _prompts_file(prompts, chars)
            spec = {
                "run": str(base / "run"),
                "prompts": str(prompts),
                "out": str(base / f"report-{chars}"),
                "threads": 1,
            }
            load = load_average()
            r = run_worker(os.path.abspath(__file__), spec, timeout_s=args.timeout_s)
            prompts.unlink()
            if "error" in r:
                rows.append((f"{chars:,}", "-", "-", "-", r["error"], f"{load:.2f}"))
                continue
            rows.append(
                (
                    f"{chars:,}",
                    str(r["status"]),
                    f"{r['peak_mib']:.0f}",
                    f"{r['seconds']:.1f}",
                    f"{chars / r['seconds']:,.0f}",
                    f"{load:.2f}",
                )
            )
    print_table(
        "inspect --prompts, one prompt of N characters, the run L2 D32 H2 x4 (vocab 256, "
        "bytes), fp32, 1 thread: peak MiB = the whole command's peak RSS (fresh process)",
        ("characters", "exit", "peak MiB", "s", "chars/s", "load"),
        rows,
    )


def train_worker(spec: dict[str, Any]) -> None:
    import torch

    from bdh_train.cli import main

    torch.set_num_threads(1)
    sets = [arg for override in RUN for arg in ("--set", override)]
    emit({"status": main(["train", "--run-dir", spec["train"], *sets])})


if __name__ == "__main__":
    from _common import worker_spec

    _spec = worker_spec()
    if _spec is None:
        main()
    elif "train" in _spec:
        train_worker(_spec)
    else:
        worker(_spec)
