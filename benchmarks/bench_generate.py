"""Generation speed: the recurrent O(1)-per-token path against re-running the whole prefix.

Config (a) (L4 D128 H4 multiplier 16, N=512, vocab 256, dropout 0), batch 1, fp32, 2 threads,
greedy decoding (temperature 0) from a 16-token random prompt, untrained weights.

* recurrent: `model.generate` / `model.stream_generate`: the prompt is consumed once, then
  every new token is one recurrent step on the carried state (executor "recurrent").
* rerun: no state; for every new token `forward_hidden` runs over the whole prefix (prompt +
  tokens so far) with the config's executor ("auto": dense up to ~400 tokens, then chunked)
  and the last position's logits pick the token. Its cost per token grows with the prefix.

Recurrent runs are separate for 64, 256 and 1024 new tokens. The rerun is one 1024-token run
whose cumulative time is read after 64, 256 and 1024 tokens (the same work, in the same order,
as separate runs). If after 256 tokens the projected time to 1024 exceeds --max-rerun-s, the
run stops there and the 1024 figure is EXTRAPOLATED (a + b * prefix per-token fit), and is
marked so. Per-token times: median over the first 64 and the last 64 tokens of the 1024 run
(token 1 includes the prompt and is left out).

Run: .venv/bin/python benchmarks/bench_generate.py [--max-rerun-s 300] [--device cuda]
"""

from __future__ import annotations

import argparse
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

from bdh_train.model import BDH, BDHConfig

CONFIG_A = CONFIGS["a"]
PROMPT_TOKENS = 16
LENGTHS = (64, 256, 1024)
WINDOW = 64  # tokens averaged for "start" and "end" per-token times


def build_model() -> BDH:
    torch.manual_seed(0)
    model = BDH(BDHConfig(**CONFIG_A, vocab_size=256, dropout=0.0))
    return model.eval()


def recurrent_run(model: BDH, prompt: torch.Tensor, n: int) -> tuple[float, list[float], list]:
    """Total seconds, per-token seconds and tokens of stream_generate for n new tokens."""
    per_token, tokens = [], []
    started = last = time.perf_counter()
    for token in model.stream_generate(prompt, n, temperature=0.0):
        now = time.perf_counter()
        per_token.append(now - last)
        tokens.append(int(token))
        last = now
    return time.perf_counter() - started, per_token, tokens


@torch.no_grad()
def rerun(model: BDH, prompt: torch.Tensor, n: int, budget_s: float) -> dict:
    """Greedy tokens by re-running the whole prefix for each; stops early if over budget."""
    seq = prompt
    per_token, tokens = [], []
    started = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        hidden = model.forward_hidden(seq)
        token = model.logits_from_hidden(hidden[:, -1]).argmax(dim=-1)
        seq = torch.cat([seq, token.view(1, 1)], dim=1)
        per_token.append(time.perf_counter() - t0)
        tokens.append(int(token))
        if i + 1 == 256 and n > 256:
            projected = project_total(per_token, n)
            if projected > budget_s:
                return {"per_token": per_token, "tokens": tokens, "projected_s": projected}
    return {"per_token": per_token, "tokens": tokens, "total_s": time.perf_counter() - started}


def project_total(per_token: list[float], n: int) -> float:
    """Least-squares a + b*i over the measured tokens (skipping the first), summed to n."""
    xs = list(range(1, len(per_token)))
    ys = per_token[1:]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    a = my - b * mx
    return sum(per_token) + sum(a + b * i for i in range(len(per_token), n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-rerun-s", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--lengths",
        default=",".join(map(str, LENGTHS)),
        help="comma list of new-token counts (the largest is the rerun's length)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each path wait up to S seconds for other processes to leave the CPUs",
    )
    args = ap.parse_args()
    lengths = tuple(sorted(int(x) for x in args.lengths.split(",")))
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_line()}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    model = build_model().to(args.device)
    prompt = torch.randint(0, 256, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(args.device)
    recurrent_run(model, prompt, 8)  # warm-up
    model.forward_hidden(prompt)

    rows = []
    rec: dict[int, tuple[float, list[float], list]] = {}
    loads: dict[str, float] = {}
    others: dict[str, float] = {}
    if args.wait_quiet > 0:
        wait_for_quiet(args.wait_quiet)
    for n in lengths:
        loads[f"rec{n}"] = load_average()
        before = cpu_counters()
        rec[n] = recurrent_run(model, prompt, n)
        others[f"rec{n}"] = others_cpu_share(before, cpu_counters())
    if args.wait_quiet > 0:
        wait_for_quiet(args.wait_quiet)
    loads["rerun"] = load_average()
    before = cpu_counters()
    rr = rerun(model, prompt, max(lengths), args.max_rerun_s)
    others["rerun"] = others_cpu_share(before, cpu_counters())
    measured = len(rr["per_token"])
    for n in lengths:
        rec_s = rec[n][0]
        if n <= measured:
            rerun_s, how = sum(rr["per_token"][:n]), "measured"
        else:
            rerun_s, how = rr["projected_s"], "EXTRAPOLATED"
        same = rec[n][2][: min(n, measured)] == rr["tokens"][: min(n, measured)]
        rows.append(
            (
                n,
                f"{n / rec_s:.1f}",
                f"{rec_s:.2f}",
                f"{n / rerun_s:.1f}",
                f"{rerun_s:.1f}",
                how,
                f"{rerun_s / rec_s:.0f}x",
                "yes" if same else "no",
                f"{100 * others[f'rec{n}']:.0f} / {100 * others['rerun']:.0f}",
                f"{loads[f'rec{n}']:.2f} / {loads['rerun']:.2f}",
            )
        )
    print_table(
        "generation, config (a), batch 1, 16-token prompt, greedy; tokens/s = new tokens / "
        "wall time (prompt included); same tokens: the two paths' greedy tokens agree; others %: "
        "CPU capacity other processes used meanwhile",
        (
            "new tokens",
            "recurrent tok/s",
            "recurrent s",
            "rerun tok/s",
            "rerun s",
            "rerun",
            "speed-up",
            "same tokens",
            "others % (rec / rerun)",
            "load (rec / rerun)",
        ),
        rows,
    )

    rec_tokens = rec[max(lengths)][1][1:]  # token 1 carries the prompt
    per = [("recurrent", rec_tokens)]
    if measured == max(lengths):
        per.append(("rerun", rr["per_token"][1:]))
    trows = []
    for label, times in per:
        start = statistics.median(times[:WINDOW]) * 1e3
        end = statistics.median(times[-WINDOW:]) * 1e3
        trows.append((label, f"{start:.2f}", f"{end:.2f}", f"{end / start:.2f}"))
    print_table(
        f"time per token in the {max(lengths)}-token run: median of tokens 2-{WINDOW + 1} "
        f"(start) and of the last {WINDOW} (end)",
        ("path", "start ms/token", "end ms/token", "end / start"),
        trows,
    )


if __name__ == "__main__":
    main()
