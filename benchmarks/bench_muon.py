"""Muon's Newton-Schulz iteration (`train.muon.orthogonalise`) against the form it replaced.

The form before (kept here as `transposed_view`): a tall matrix's iteration ran on its
transposed view, and each step's sums a X + (b G + c G G) X were separate tensors. The
product's form runs on the wide orientation made contiguous, as a stack, and takes the sums
into `baddbmm`. Both give the same update to float32 rounding (the last column: the largest
difference over the case's matrices).

Cases: the matrices Muon updates in one step of the tiny preset (the two per-head encoders
[4, 128, 256] and the decoder [1024, 128]) and of `recipe.py`'s four-layer GPT of equal size
(width 96: qkv [288, 96], proj [96, 96], MLP [384, 96] and [96, 384], four layers), and the
small preset's (L6 D256 H4 N2048: encoders [4, 256, 2048], decoder [8192, 256]). The forms
take turns call by call on the same matrices, so machine load hits both alike; the time is
each form's median over the calls for the whole case, the ratio the median over the calls
of before / after (quartiles beside it), others % the share of the CPUs other processes used.

Run: .venv/bin/python benchmarks/bench_muon.py [--calls 40] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import cpu_counters, machine_line, others_cpu_share, print_table

from bdh_train.train.muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, orthogonalise

GPT_LAYER = [(288, 96), (96, 96), (384, 96), (96, 384)]
CASES = {
    "tiny preset (encoders, decoder)": [(4, 128, 256), (4, 128, 256), (1024, 128)],
    "recipe.py's GPT, 4 layers of width 96": GPT_LAYER * 4,
    "small preset (encoders, decoder)": [(4, 256, 2048), (4, 256, 2048), (8192, 256)],
}


def transposed_view(update: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The iteration as it was: a tall matrix's transposed view, the sums as tensors."""
    a, b, c = NS_COEFFICIENTS
    tall = update.size(-2) > update.size(-1)
    x = update.mT if tall else update
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def timed(fn, matrices: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    started = time.perf_counter()
    out = [fn(m) for m in matrices]
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_line()}; threads {args.threads}")
    rows = []
    for name, shapes in CASES.items():
        gen = torch.Generator().manual_seed(0)
        matrices = [torch.randn(s, generator=gen) for s in shapes]
        for _ in range(3):  # warm-up
            timed(transposed_view, matrices), timed(orthogonalise, matrices)
        before_s, after_s, ratios, gap = [], [], [], 0.0
        counters = cpu_counters()
        for call in range(args.calls):
            pair = [(transposed_view, before_s), (orthogonalise, after_s)]
            outs = {}
            for fn, times in pair if call % 2 == 0 else pair[::-1]:
                took, outs[fn] = timed(fn, matrices)
                times.append(took)
            ratios.append(before_s[-1] / after_s[-1])
            for old, new in zip(outs[transposed_view], outs[orthogonalise], strict=True):
                gap = max(gap, float((old - new).abs().max()))
        others = others_cpu_share(counters, cpu_counters())
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        rows.append(
            [
                name,
                f"{statistics.median(before_s) * 1e3:.2f}",
                f"{statistics.median(after_s) * 1e3:.2f}",
                f"{statistics.median(ratios):.3f}x ({q1:.3f}-{q3:.3f})",
                f"{gap:.1e}",
                f"{others:.0%}",
            ]
        )
    headers = [
        "matrices of one step",
        "before ms",
        "after ms",
        "before / after",
        "max gap",
        "others",
    ]
    print_table(f"Newton-Schulz, {NS_STEPS} steps, float32, {args.calls} calls each", headers, rows)


if __name__ == "__main__":
    main()
