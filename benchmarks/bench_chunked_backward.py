"""The mixer's hand-written backward against autograd through the same products.

For each (B, T, C) point, queries q [B, H, T, N] (relu of a normal draw, as the model's
neurons are), a shared value v [B, 1, T, D], an incoming state and upstream gradients on the
output and the final state, one forward and backward of:

* function: `chunked_attention` without decay (C < T) or `dense_attention` (C = T), which
  run as `model/chunked_grad.py`'s ChunkedAttention;
* autograd: `chunked_by_products` with the same chunk, the products autograd differentiates
  (what both executors ran before);
* resets: the function with 3 documents starting mid-row in every row (seeded positions), as
  `training.stream_documents = "corpus"` gives it; before the Function took reset masks, such
  calls ran their chunks one after another;
* decay function / decay autograd: the same two forms with alibi's per-head decay (what
  `position = "alibi"` runs; autograd is what it ran before the Function took decay);
* both function / both autograd: resets and alibi's decay together (what an alibi run
  streaming a corpus's documents calls: `training.stream_documents = "corpus"` resets a row
  mid-block where its next document starts; fixed-length streaming resets only at a block's
  first token, which the model applies to the incoming state instead), through the Function
  and through the autograd form the dispatch sent them to before the Function took both
  (dense's masked products, chunked's chunk-by-chunk loop).

The two alternate, one call each in turn; the table gives the fastest of --rounds calls (ms)
and their ratio. H=4, N=512, D=128 (config a's mixer), fp32; on the CPU 2 threads and the
host allocator 'retain' (what the trainer sets there).

Run: .venv/bin/python benchmarks/bench_chunked_backward.py [--rounds 4] [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import document_starts, machine_line, print_table

from bdh_train.model import mixer
from bdh_train.model.positions import alibi_log_decay
from bdh_train.train.allocator import configure_host_allocator

HEADS, NEURONS, EMBD = 4, 512, 128
POINTS = ((8, 128, 128), (8, 512, 128), (8, 512, 512), (8, 2048, 128), (2, 2048, 128))
"""(B, T, C); (8, 128, 128) is the tiny preset's block (8 x 128, one chunk: dense)."""
RESETS_PER_ROW = 3


def inputs(batch: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "q": (batch, HEADS, seq_len, NEURONS),
        "v": (batch, 1, seq_len, EMBD),
        "rho0": (batch, HEADS, NEURONS, EMBD),
        "d_out": (batch, HEADS, seq_len, EMBD),
        "d_final": (batch, HEADS, NEURONS, EMBD),
    }
    drawn = {name: torch.randn(shape, generator=g).to(device) for name, shape in shapes.items()}
    drawn["q"] = drawn["q"].relu_()
    for name in ("q", "v", "rho0"):
        drawn[name].requires_grad_()
    return tuple(drawn.values())


def under_autograd(form):
    """`form` run with the dispatch sending every call to the autograd form (the Function
    refused), as it sent resets with decay before the Function took both."""

    def run():
        real = mixer._hand_written_backward_applies
        mixer._hand_written_backward_applies = lambda q, log_decay: False
        try:
            return form()
        finally:
            mixer._hand_written_backward_applies = real

    return run


def fastest_calls(
    batch: int, seq_len: int, chunk: int, rounds: int, device: torch.device
) -> dict[str, float]:
    """Seconds of the fastest forward + backward of each form, the forms alternating."""
    q, v, rho0, d_out, d_final = inputs(batch, seq_len, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    executor = mixer.dense_attention if chunk == seq_len else mixer.chunked_attention
    mask = document_starts(batch, seq_len, RESETS_PER_ROW, device)
    log_decay = alibi_log_decay(HEADS)

    def both():
        return executor(
            q, v, initial_state=rho0, chunk_size=chunk, reset_mask=mask, log_decay=log_decay
        )

    forms = {
        "function": lambda: executor(q, v, initial_state=rho0, chunk_size=chunk),
        "autograd": lambda: mixer.chunked_by_products(q, v, rho0, None, chunk, True),
        "resets": lambda: executor(q, v, initial_state=rho0, chunk_size=chunk, reset_mask=mask),
        "decay function": lambda: executor(
            q, v, initial_state=rho0, chunk_size=chunk, log_decay=log_decay
        ),
        "decay autograd": lambda: mixer.chunked_by_products(q, v, rho0, log_decay, chunk, True),
        "both function": both,
        "both autograd": under_autograd(both),
    }
    best = {name: float("inf") for name in forms}
    for round_index in range(rounds + 1):  # round 0 warms up
        for name, form in forms.items():
            sync()
            start = time.perf_counter()
            out, final = form()
            torch.autograd.backward([out, final], [d_out, d_final])
            sync()
            elapsed = time.perf_counter() - start
            q.grad = v.grad = rho0.grad = None
            if round_index:
                best[name] = min(best[name], elapsed)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    allocator = configure_host_allocator("auto", device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine_line()
    print(f"machine: {where}; host allocator: {allocator}")
    rows = []
    for batch, seq_len, chunk in POINTS:
        best = fastest_calls(batch, seq_len, chunk, args.rounds, device)
        name = "dense" if chunk == seq_len else f"chunked/{chunk}"
        ratio = best["autograd"] / best["function"]
        decay_ratio = best["decay autograd"] / best["decay function"]
        rows.append(
            (
                batch,
                seq_len,
                name,
                f"{best['function'] * 1e3:.0f}",
                f"{best['autograd'] * 1e3:.0f}",
                f"{ratio:.2f}x",
                f"{best['resets'] * 1e3:.0f}",
                f"{best['decay function'] * 1e3:.0f}",
                f"{best['decay autograd'] * 1e3:.0f}",
                f"{decay_ratio:.2f}x",
                f"{best['both function'] * 1e3:.0f}",
                f"{best['both autograd'] * 1e3:.0f}",
                f"{best['both autograd'] / best['both function']:.2f}x",
            )
        )
    print_table(
        f"mixer forward + backward on {args.device}, H={HEADS} N={NEURONS} D={EMBD}, fp32 "
        f"({args.threads} CPU threads), with an incoming and a final state; ms, fastest of "
        f"{args.rounds} alternating calls",
        (
            "B",
            "T",
            "executor",
            "function ms",
            "autograd ms",
            "autograd / function",
            f"function, {RESETS_PER_ROW} resets per row, ms",
            "alibi decay: function ms",
            "autograd ms",
            "autograd / function",
            "resets and decay: function ms",
            "autograd ms",
            "autograd / function",
        ),
        rows,
    )


if __name__ == "__main__":
    main()
