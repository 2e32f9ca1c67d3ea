"""Training quality on real text (issue 7's quality bar). Prints tables; not a test.

1. `tiny`: the default `bdh-train train` (the tiny preset, on its corpus): wall time, the
   validation curve, and the unigram byte entropy of the corpus it must beat.
2. `shakespeare`: on tinyshakespeare, the validation loss after a fixed token budget for
   full-context training (random 256-token windows) vs streaming TBPTT (64-token blocks of
   1024-token logical documents, state carried across steps), at the same tokens per step.

    python benchmarks/bench_quality.py tiny
    python benchmarks/bench_quality.py shakespeare          # --data SOURCE: another text
"""

from __future__ import annotations

import argparse
import io
import math
import tempfile
import time
from collections import Counter
from pathlib import Path

from bdh_train.config import load_config
from bdh_train.data import builtin_corpus, eval_batches
from bdh_train.train.metrics import read_metrics
from bdh_train.train.step import LanguageTrainModel
from bdh_train.training.trainer import Trainer


def unigram_entropy_nats(data: bytes) -> float:
    counts = Counter(data)
    total = len(data)
    return -sum(c / total * math.log(c / total) for c in counts.values())


def train(overrides: list[str], run_dir: Path) -> tuple[float, list[dict], Trainer]:
    cfg = load_config(overrides=overrides)
    start = time.perf_counter()
    trainer = Trainer(cfg, run_dir, stream=io.StringIO())
    trainer.run()
    return time.perf_counter() - start, read_metrics(run_dir / "metrics.jsonl"), trainer


def val_loss_at(trainer: Trainer, block_size: int, max_batches: int = 8) -> float:
    """Validation loss with `block_size` tokens of context from a fresh state."""
    step = LanguageTrainModel(trainer.model)
    total = count = 0.0
    for batch in eval_batches(trainer.val_data, block_size, 8, max_batches):
        loss_sum, n = step.eval_loss(batch)
        total += loss_sum
        count += n
    return total / count


def bench_tiny(args: argparse.Namespace) -> None:
    source = load_config().data.source
    text = builtin_corpus(source.removeprefix("builtin:")).encode()
    val = text[int(len(text) * 0.9) :]
    h_train = unigram_entropy_nats(text)
    h_val = unigram_entropy_nats(val)
    with tempfile.TemporaryDirectory() as tmp:
        seconds, rows, _ = train([], Path(tmp))
        final = [r for r in rows if "loss" in r][-1]
        print(
            f"tiny preset on {source}: {final['step']} steps, {final['tokens']} tokens, "
            f"{seconds:.0f} s wall ({final['tokens'] / seconds:.0f} tok/s overall)"
        )
        print(
            f"unigram byte entropy: corpus {h_train:.3f} nats ({h_train / math.log(2):.3f} "
            f"bits), validation split {h_val:.3f} nats"
        )
        print(f"{'step':>6} {'tokens':>9} {'train loss':>10} {'val loss':>9} {'bits/byte':>9}")
        train_loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
        tokens = {r["step"]: r["tokens"] for r in rows if "loss" in r}
        for r in rows:
            if "val_loss" in r:
                s = r["step"]
                print(
                    f"{s:>6} {tokens.get(s, 0):>9} {train_loss.get(s, float('nan')):>10.4f} "
                    f"{r['val_loss']:>9.4f} {r['bits_per_byte']:>9.3f}"
                )


def bench_shakespeare(args: argparse.Namespace) -> None:
    common = [
        f"data.source='{args.data}'",
        "data.val_fraction=0.1",
        f"training.max_steps={args.steps}",
        "training.log_every=10",
        f"training.eval_every={args.steps // 4}",
        "training.eval_steps=8",
        "training.checkpoint_every=0",
        "optimizer.warmup_steps=20",
        "optimizer.lr=3e-3",
        "optimizer.min_lr=3e-4",
    ]
    variants = {
        "full context (T=256, random windows)": [
            *common,
            "training.block_size=256",
            "training.batch_size=8",
            "training.tbptt_persist_across_steps=false",  # the preset streams
            "training.min_logical_block_size=0",
        ],
        "streaming TBPTT (T=64 blocks of 1024-token docs)": [
            *common,
            "training.block_size=64",
            "training.batch_size=32",
            "training.tbptt_persist_across_steps=true",
            "training.min_logical_block_size=1024",
        ],
    }
    print(
        f"tinyshakespeare, {args.steps} steps x 2048 tokens = {args.steps * 2048} tokens each; "
        "validation loss (nats/byte) from a fresh state with 256 and 1024 tokens of context"
    )
    print(f"{'variant':<50} {'tok/s':>7} {'val@256':>8} {'val@1024':>9} {'wall s':>7}")
    for name, overrides in variants.items():
        with tempfile.TemporaryDirectory() as tmp:
            seconds, rows, trainer = train(overrides, Path(tmp))
            tokens = [r for r in rows if "loss" in r][-1]["tokens"]
            print(
                f"{name:<50} {tokens / seconds:>7.0f} {val_loss_at(trainer, 256):>8.4f} "
                f"{val_loss_at(trainer, 1024, 2):>9.4f} {seconds:>7.0f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="which", required=True)
    sub.add_parser("tiny")
    p = sub.add_parser("shakespeare")
    p.add_argument("--data", default="builtin:shakespeare")
    p.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    {"tiny": bench_tiny, "shakespeare": bench_shakespeare}[args.which](args)


if __name__ == "__main__":
    main()
