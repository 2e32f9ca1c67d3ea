"""Generation speed: the fast decoder against the generic recurrent step (and, with --rerun,
against re-running the whole prefix).

Config (a) (L4 D128 H4 multiplier 16, N=512, vocab 256, dropout 0), fp32, 2 threads, greedy
decoding (temperature 0), untrained weights, random 16-token prompts.

* fast: `stream_generate(model, ..., decoder="fast")`: the prompt is read once, then each new
  token is one `FastDecoder.step` (weights folded once, state updated in place; on CUDA the
  step is a replayed CUDA graph).
* fast, no graph (CUDA only): the same with the eager step.
* generic: the same with `decoder="generic"`: each new token is
  `forward_hidden(token, state, executor="recurrent")`, the model's own layer code.
* rerun (--rerun): no state; for every new token `forward_hidden` runs over the whole prefix
  (executor "auto") and the last position's logits pick the token; grows with the prefix.

Batch 1: one run of --tokens new tokens per decoder; the time of each token is the wall time
between two yielded tokens (the step that reads the previous token, the head and the
sampling). Reported: the median over 64-token windows starting at tokens 2, 1024 and the
last 64 (token 1 carries the prompt and is left out); the generic decoder runs --generic-tokens.
Batch 16: 16 prompts of 16 tokens, `stream_generate_batch` for --batch-tokens new tokens per
row; tokens/s = 16 * new tokens / wall time of the decoding (prompt reading excluded; it is
listed apart). CPU columns divide by the process's CPU time instead of wall time: with
--threads 1 on a shared machine they estimate what the run would take alone.

Run: .venv/bin/python benchmarks/bench_generate.py [--wait-quiet 300] [--rerun]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time

import torch
from _common import (
    CONFIGS,
    cpu_counters,
    load_average,
    machine_line,
    others_cpu_share,
    print_table,
    wait_for_quiet,
)

from bdh_train.model import BDH, BDHConfig, decoders
from bdh_train.model import sampling as generation

CONFIG_A = CONFIGS["a"]
PROMPT_TOKENS = 16
WINDOW = 64  # tokens per median window
BATCH = 16


@contextlib.contextmanager
def fast_decoder_without_graph():
    """The fast decoder with its eager step where it would run the fixed-shape (CUDA graph)
    one: the launch cost the graph saves."""
    real = decoders.FastDecoder
    decoders.FastDecoder = functools.partial(real, static=False)  # what make_decoder builds
    try:
        yield
    finally:
        decoders.FastDecoder = real


def build_model() -> BDH:
    torch.manual_seed(0)
    model = BDH(BDHConfig(**CONFIG_A, vocab_size=256, dropout=0.0))
    return model.eval()


CPU_SECONDS: list[float] = []
"""Process CPU seconds of each `timed_stream` (all threads): on a shared machine, with one
thread, close to the wall time the stream would take alone."""


def timed_stream(stream) -> tuple[list[float], list[torch.Tensor]]:
    """Seconds before each yielded item (the first includes the prompt) and the items."""
    per_item, items = [], []
    cpu = time.process_time()
    last = time.perf_counter()
    for item in stream:
        int(item[0])  # the token is on the host, as a caller printing it needs
        now = time.perf_counter()
        per_item.append(now - last)
        items.append(item)
        last = now
    CPU_SECONDS.append(time.process_time() - cpu)
    return per_item, items


def windows(per_token: list[float]) -> dict[str, float | None]:
    """Median ms per token over tokens 2-65, 1024-1087 and the last 64 (1-based)."""
    n = len(per_token)
    out: dict[str, float | None] = {
        "~1": statistics.median(per_token[1 : 1 + WINDOW]) * 1e3 if n > WINDOW else None,
        "~1024": None,
        "end": statistics.median(per_token[-WINDOW:]) * 1e3 if n > WINDOW else None,
    }
    if n >= 1023 + WINDOW:
        out["~1024"] = statistics.median(per_token[1023 : 1023 + WINDOW]) * 1e3
    return out


@torch.no_grad()
def rerun(model: BDH, prompt: torch.Tensor, n: int) -> list[float]:
    """Seconds per greedy token when every token re-runs the whole prefix."""
    seq, per_token = prompt, []
    for _ in range(n):
        t0 = time.perf_counter()
        hidden = model.forward_hidden(seq)
        token = model.logits_from_hidden(hidden[:, -1]).argmax(dim=-1)
        seq = torch.cat([seq, token.view(1, 1)], dim=1)
        per_token.append(time.perf_counter() - t0)
    return per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tokens", type=int, default=4096, help="batch-1 fast run, new tokens")
    ap.add_argument("--generic-tokens", type=int, default=1088)
    ap.add_argument("--batch-tokens", type=int, default=512, help="batch-16 new tokens per row")
    ap.add_argument(
        "--rerun",
        type=int,
        default=0,
        metavar="N",
        help="also re-run the whole prefix for N new tokens (slow: ~76 s for 1024)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each run wait up to S seconds for other processes to leave the CPUs",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_line()}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    device = torch.device(args.device)
    model = build_model().to(device)
    seeds = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (1, PROMPT_TOKENS), generator=seeds).to(device)
    prompts = [
        torch.randint(0, 256, (PROMPT_TOKENS,), generator=seeds).to(device) for _ in range(BATCH)
    ]
    for decoder in ("fast", "generic"):  # warm-up
        list(generation.stream_generate(model, prompt, 16, 0.0, decoder=decoder))
        list(generation.stream_generate_batch(model, prompts, 16, 0.0, decoder=decoder))

    def measure(label: str, fn):
        if args.wait_quiet > 0:
            wait_for_quiet(args.wait_quiet)
        load, before = load_average(), cpu_counters()
        result = fn()
        return result, f"{100 * others_cpu_share(before, cpu_counters()):.0f}", f"{load:.2f}"

    variants = {"fast": ("fast", contextlib.nullcontext)}
    if device.type == "cuda":
        variants["fast, no graph"] = ("fast", fast_decoder_without_graph)
    variants["generic"] = ("generic", contextlib.nullcontext)
    rows, tokens_by = [], {}
    for label, (decoder, context) in variants.items():
        n = args.generic_tokens if decoder == "generic" else args.tokens

        def run_one(n=n, d=decoder, context=context):
            with context():
                return timed_stream(generation.stream_generate(model, prompt, n, 0.0, decoder=d))

        (per_token, items), others, load = measure(label, run_one)
        tokens_by[label] = [int(t[0]) for t in items]
        w = windows(per_token)
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        flat = "-" if w["end"] is None or w["~1"] is None else f"{w['end'] / w['~1']:.2f}"
        rows.append(
            (
                label,
                n,
                fmt(w["~1"]),
                fmt(w["~1024"]),
                fmt(w["end"]),
                flat,
                f"{n / sum(per_token):.0f}",
                f"{CPU_SECONDS[-1] / n * 1e3:.3f}",
                others,
                load,
            )
        )
    if args.rerun:
        per_token, others, load = measure("rerun", lambda: rerun(model, prompt, args.rerun))
        w = windows(per_token)
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        flat = "-" if w["end"] is None or w["~1"] is None else f"{w['end'] / w['~1']:.2f}"
        rows.append(
            (
                "rerun",
                args.rerun,
                fmt(w["~1"]),
                fmt(w["~1024"]),
                fmt(w["end"]),
                flat,
                f"{args.rerun / sum(per_token):.0f}",
                "-",
                others,
                load,
            )
        )
    common = min(len(tokens_by["fast"]), len(tokens_by["generic"]))
    same = tokens_by["fast"][:common] == tokens_by["generic"][:common]
    print_table(
        f"batch 1, config (a), {PROMPT_TOKENS}-token prompt, greedy: ms per token, median over "
        f"{WINDOW}-token windows starting at token 2 (~1), 1024 (~1024) and the last {WINDOW} "
        f"(end); tok/s = new tokens / wall time (prompt included); fast and generic tokens "
        f"agree: {'yes' if same else 'NO'} (first {common}); others %: CPU capacity other "
        "processes used meanwhile",
        (
            "decoder",
            "new tokens",
            "ms ~1",
            "ms ~1024",
            "ms end",
            "end / ~1",
            "tok/s",
            "CPU ms/token",
            "others %",
            "load",
        ),
        rows,
    )

    brows = []
    for label, (decoder, context) in variants.items():

        def run(d=decoder, context=context):
            with context():
                t0 = time.perf_counter()
                stream = generation.stream_generate_batch(
                    model, prompts, args.batch_tokens, 0.0, decoder=d
                )
                first = next(stream)  # the prompts are read before the first token
                prompt_s = time.perf_counter() - t0
                per_step, _ = timed_stream(stream)
            return prompt_s, per_step, first

        (prompt_s, per_step, _), others, load = measure(label, run)
        decode_s = sum(per_step)
        steps = len(per_step)
        brows.append(
            (
                label,
                BATCH,
                args.batch_tokens,
                f"{prompt_s * 1e3:.1f}",
                f"{statistics.median(per_step) * 1e3:.3f}",
                f"{BATCH * steps / decode_s:.0f}",
                f"{BATCH * steps / CPU_SECONDS[-1]:.0f}",
                others,
                load,
            )
        )
    print_table(
        f"batch {BATCH}, config (a), {PROMPT_TOKENS}-token prompts, greedy: tokens/s = "
        f"{BATCH} x new tokens after the first / wall time of those steps",
        (
            "decoder",
            "batch",
            "new tokens",
            "prompts ms",
            "ms per step",
            "tokens/s",
            "tokens per CPU s",
            "others %",
            "load",
        ),
        brows,
    )


if __name__ == "__main__":
    main()
