"""Saved-for-backward memory of BDH's quantized projections (spec §9, saved_activations).

For each targeted projection (BDH shapes, one layer's call) and for a whole-model forward, sums
the bytes of every tensor autograd saves for backward (torch.autograd.graph.saved_tensors_hooks),
counting each storage once and skipping parameters (they are held by the model anyway, so
saving a reference costs nothing). Compares:

    float      unquantized product, as the float model computes it (per_head_matmul)
    qat_ste    fake quantization + STE
    kernel     train_kernel, float operands saved (saved_activations = none)
    kernel+q8  train_kernel + quantized_cache_recompute (int8 input codes + per-token scales)

Run: .venv/bin/python benchmarks/bench_quant_memory.py [--batch 4 --seq 256 --embd 256 ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bdh_train.model import BDH, BDHConfig, QuantConfig
from bdh_train.model.matmul import per_head_matmul
from bdh_train.model.quant import quantized_projection

MODES: dict[str, QuantConfig | None] = {
    "float": None,
    "qat_ste": QuantConfig(enable=True),
    "kernel": QuantConfig(enable=True, training_mode="train_kernel"),
    "kernel+q8": QuantConfig(
        enable=True, training_mode="train_kernel", saved_activations="quantized_cache_recompute"
    ),
}


def saved_bytes(run: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while `run()` builds a graph."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(seen.values())


def projection_table(b: int, t: int, d: int, h: int, n: int) -> list[tuple[str, dict[str, int]]]:
    g = torch.Generator().manual_seed(0)
    cases = {
        "decoder_x  u @ encoder": ((b, 1, t, d), (h, d, n)),
        "decoder_y  a @ encoder_v": ((b, h, t, d), (h, d, n)),
        "encoder    y @ decoder": ((b, 1, t, h * n), (h * n, d)),
    }
    rows = []
    for label, (xs, ws) in cases.items():
        x = torch.randn(xs, generator=g).requires_grad_()
        w = (torch.randn(ws, generator=g) * 0.02).requires_grad_()
        row = {}
        for mode, cfg in MODES.items():
            if cfg is None:
                row[mode] = saved_bytes(lambda x=x, w=w: per_head_matmul(x, w), [w])
            else:
                row[mode] = saved_bytes(lambda x=x, w=w, c=cfg: quantized_projection(x, w, c), [w])
        rows.append((label, row))
    total = {m: sum(r[m] for _, r in rows) for m in MODES}
    rows.append(("all three projections", total))
    return rows


def model_row(b: int, t: int, d: int, h: int, mult: int, layers: int) -> dict[str, int]:
    idx = torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(0))
    row = {}
    for mode, cfg in MODES.items():
        torch.manual_seed(0)
        config = BDHConfig(
            n_layer=layers,
            n_embd=d,
            n_head=h,
            mlp_internal_dim_multiplier=mult,
            dropout=0.0,
            executor="dense",
            quant=cfg or QuantConfig(),
        )
        model = BDH(config)
        row[mode] = saved_bytes(lambda m=model: m(idx, idx)[1], list(model.parameters()))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--mult", type=int, default=32, help="mlp_internal_dim_multiplier")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    n = args.mult * args.embd // args.heads
    print(
        f"B={args.batch} T={args.seq} D={args.embd} H={args.heads} N={n} "
        f"(one call per projection; whole model: {args.layers} layers, dense executor)\n"
    )
    mib = 1 << 20
    head = f"{'saved for backward (MiB)':<28}" + "".join(f"{m:>11}" for m in MODES)
    head += f"{'q8/kernel':>11}{'q8/float':>10}"
    print(head)
    print("-" * len(head))
    rows = projection_table(args.batch, args.seq, args.embd, args.heads, n)
    rows.append(
        (
            f"whole model ({args.layers} layers)",
            model_row(args.batch, args.seq, args.embd, args.heads, args.mult, args.layers),
        )
    )
    for label, row in rows:
        cells = "".join(f"{row[m] / mib:>11.2f}" for m in MODES)
        ratio_k = row["kernel+q8"] / row["kernel"]
        ratio_f = row["kernel+q8"] / row["float"]
        print(f"{label:<28}{cells}{ratio_k:>10.1%}{ratio_f:>10.1%}")


if __name__ == "__main__":
    main()
