"""The measurements behind mixer.EXECUTOR_CALIBRATION: train steps of one model under several
executors and chunk sizes, alternating in one process.

For each "config:T:B:name,name,..." spec (config a or b of _common.CONFIGS, vocab 256, fp32,
dropout 0; on the CPU 2 threads and the host allocator as the trainer sets it), one model and
one AdamW run a warm-up step per name, then --rounds rounds of one step per name in turn, so
load from other processes falls on every name alike. Names: dense (in the device's calibrated
row panels), dense/P (in row panels of P queries; dense/0: the whole matrix), chunked/C, and
naive (the official masked form, `(q @ q^T).tril(-1) @ v`, patched in as an executor); a name
ending in "+resets" runs its executor on the same batch with 3 documents starting inside
every row (seeded positions: what `training.stream_documents = "corpus"` gives the model).
tokens/s from the fastest step.

Run: .venv/bin/python benchmarks/bench_calibration.py            # the default specs
     .venv/bin/python benchmarks/bench_calibration.py a:512:8:dense,chunked/128
     .venv/bin/python benchmarks/bench_calibration.py a:512:8:dense/0,dense/64,dense/128
     .venv/bin/python benchmarks/bench_calibration.py a:2048:8:chunked/128,chunked/128+resets
     python3 benchmarks/bench_calibration.py --device cuda --specs-set cuda
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from _common import (
    CONFIGS,
    document_starts,
    load_average,
    machine_line,
    print_table,
    timed_train_step,
)

from bdh_train.model import BDH, BDHConfig, mixer
from bdh_train.train.allocator import configure_host_allocator

DEFAULT_SPECS = (
    "a:256:8:naive,dense,chunked/64,chunked/128",
    "a:512:8:naive,dense,chunked/64,chunked/128,chunked/256",
    "a:1024:8:dense,chunked/64,chunked/128,chunked/256",
    "a:2048:8:chunked/64,chunked/128,chunked/256",
    "b:256:4:dense,chunked/64,chunked/128",
    "b:512:4:dense,chunked/128,chunked/256",
)
CUDA_SPECS = (
    "a:512:8:naive,dense,dense/128,dense/256,chunked/64,chunked/128,chunked/256",
    "a:2048:8:naive,dense,dense/256,chunked/64,chunked/128,chunked/256,chunked/512",
    "a:8192:4:dense,chunked/128,chunked/256,chunked/512",
    "b:512:4:naive,dense,dense/128,chunked/128,chunked/256",
    "b:2048:4:dense,dense/256,chunked/128,chunked/256,chunked/512",
)
SPEC_SETS = {"cpu": DEFAULT_SPECS, "cuda": CUDA_SPECS}
RESETS_PER_ROW = 3


def naive_attention(
    q,
    v,
    *,
    initial_state=None,
    log_decay=None,
    chunk_size=0,
    output_final_state=True,
    reset_mask=None,
):
    """The official masked form: no state, no decay (what a rope model without a carried
    state needs)."""
    return (q @ q.transpose(-1, -2)).tril(diagonal=-1) @ v, None


def run(spec: str, rounds: int, device: torch.device, autocast_dtype=None) -> list:
    config, seq_len, batch, names = spec.split(":")
    seq_len, batch, names = int(seq_len), int(batch), names.split(",")
    mixer.EXECUTOR_FUNCTIONS.setdefault("naive", naive_attention)
    torch.manual_seed(0)
    model = BDH(BDHConfig(**CONFIGS[config], vocab_size=256, dropout=0.0)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (batch, seq_len), device=device)
    y = torch.randint(0, 256, (batch, seq_len), device=device)
    starts = document_starts(batch, seq_len, RESETS_PER_ROW, device)

    calibrated = mixer.calibration_for(device.type)

    def step(name: str) -> float:
        executor_name, _, resets = name.partition("+")
        executor, _, size = executor_name.partition("/")
        model.config.executor = executor
        model.config.chunk_size = int(size) if size and executor != "dense" else 0
        panel_rows = int(size) if size and executor == "dense" else calibrated.dense_panel_rows
        mixer.EXECUTOR_CALIBRATION[device.type] = dataclasses.replace(
            calibrated, dense_panel_rows=panel_rows
        )
        mask = starts if resets == "resets" else None
        try:
            return timed_train_step(model, optimizer, x, y, autocast_dtype, reset_mask=mask)
        finally:
            mixer.EXECUTOR_CALIBRATION[device.type] = calibrated

    load = load_average()
    for name in names:
        step(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            times[name].append(step(name))
    speed = {name: batch * seq_len / min(t) for name, t in times.items()}
    best = max(speed, key=speed.get)
    cells = "  ".join(f"{name} {speed[name]:.0f}" for name in names)
    print(f"{config} T={seq_len} B={batch}: {cells}", flush=True)
    return [config, seq_len, batch, cells, best, f"{load:.2f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("specs", nargs="*", help="config:T:B:names specs (default: --specs-set's)")
    ap.add_argument(
        "--specs-set",
        choices=sorted(SPEC_SETS),
        default=None,
        help="the default specs of a device type (default: --device's)",
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: the forward under bf16 autocast",
    )
    args = ap.parse_args()
    autocast_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    specs = args.specs or list(SPEC_SETS[args.specs_set or device.type])
    if device.type == "cpu":
        torch.set_num_threads(2)
        allocator = configure_host_allocator("auto", device)
        print(f"machine: {machine_line()}; host allocator: {allocator}")
    else:
        print(f"machine: {machine_line()}; device: {torch.cuda.get_device_name(device)}")
    rows = [run(spec, args.rounds, device, autocast_dtype) for spec in specs]
    print_table(
        f"train step (forward, backward, AdamW) tokens/s, {args.dtype}, fastest of the "
        "rounds; executors alternate step by step in one process",
        ["cfg", "T", "B", "tokens/s per executor", "fastest", "load"],
        rows,
    )


if __name__ == "__main__":
    main()
