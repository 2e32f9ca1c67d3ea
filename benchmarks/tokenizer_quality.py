"""Bytes vs byte-level BPE on the same text, the same model, the same tokens per step and the
same wall-clock budget: validation bits per UTF-8 byte (the number that compares across
vocabularies), loss per token and the steps each managed. Prints a table; not a test.

The text's first 90 % (by characters) is the train split, the rest the validation split; each
BPE is trained on the train split only. Every run trains `--budget-s` seconds (a timer asks
the trainer to stop at the next micro-step) with a constant learning rate after warm-up, so
no run's schedule depends on a step count it cannot know; then the whole validation split is
evaluated with `train/evaluate.py`, the one home of bits per byte.

    python benchmarks/tokenizer_quality.py                       # tinyshakespeare, 120 s each
    python benchmarks/tokenizer_quality.py --data corpus.txt --budget-s 600 --vocab 2000 8000
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from _common import CONFIGS, cpu_counters, format_table, machine_line, others_cpu_share

from bdh_train.config import load_config
from bdh_train.data import TokenData, write_token_file
from bdh_train.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe
from bdh_train.train.evaluate import evaluate
from bdh_train.train.step import LanguageTrainModel
from bdh_train.training.trainer import Trainer

DEFAULT_DATA = Path("/work/shared/data/tinyshakespeare.txt")


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    cut = int(len(text) * (1 - val_fraction))
    return text[:cut], text[cut:]


def train_for(
    tokenizer: ByteTokenizer | HFTokenizer, train_text: str, val_text: str, args, work: Path
) -> dict[str, object]:
    """Train one model on `train_text` encoded with `tokenizer` for the budget; evaluate on
    `val_text` encoded the same way."""
    name = "bytes" if isinstance(tokenizer, ByteTokenizer) else f"bpe{tokenizer.vocab_size}"
    work.mkdir(parents=True)
    train_ids = np.asarray(tokenizer.encode(train_text), dtype=np.int64)
    val_ids = np.asarray(tokenizer.encode(val_text), dtype=np.int64)
    source = write_token_file(work / "train.bin", train_ids, tokenizer.vocab_size)
    overrides = [
        *(f"model.{key}={value}" for key, value in CONFIGS[args.model].items()),
        f"data.source='{source}'",
        "data.val_fraction=0",
        f"training.block_size={args.block_size}",
        f"training.batch_size={args.batch_size}",
        f"training.max_steps={10**7}",
        "training.eval_every=0",
        "training.checkpoint_every=0",
        "training.log_every=0",
        f"training.threads={args.threads}",
        "training.device='cpu'",
        "optimizer.schedule='constant'",
        f"optimizer.lr={args.lr}",
    ]
    if isinstance(tokenizer, HFTokenizer):
        overrides.append(f"data.tokenizer='{tokenizer.save(work)}'")
    trainer = Trainer(load_config(overrides=overrides), work / "run", stream=io.StringIO())
    timer = threading.Timer(args.budget_s, trainer.request_stop)
    before = cpu_counters()
    started = time.perf_counter()
    timer.start()
    try:
        result = trainer.run()
    finally:
        timer.cancel()
    took = time.perf_counter() - started
    others = others_cpu_share(before, cpu_counters())
    val = TokenData(val_ids, tokenizer.vocab_size, f"{name} validation split")
    trainer.model.eval()
    measured = evaluate(
        LanguageTrainModel(trainer.model),
        val,
        args.block_size,
        args.batch_size,
        args.eval_batches,
        byte_lengths=tokenizer.token_byte_lengths(),
        head=trainer.model.config.language_head,
    )
    return {
        "tokenizer": name,
        "vocab": tokenizer.vocab_size,
        "bytes/token": f"{len(val_text.encode('utf-8')) / len(val_ids):.2f}",
        "steps": result.step,
        "train s": f"{took:.0f}",
        "others' CPU": f"{others:.0%}",
        "val loss/token": f"{measured.val_loss:.4f}",
        "val bits/byte": f"{measured.bits_per_byte:.4f}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA if DEFAULT_DATA.is_file() else None,
        help=f"a UTF-8 text file (default: {DEFAULT_DATA} when it exists)",
    )
    parser.add_argument("--budget-s", type=float, default=120.0, help="training seconds per run")
    parser.add_argument(
        "--vocab",
        type=int,
        nargs="+",
        default=[2000, 8000],
        help="BPE vocabulary sizes (bytes always runs)",
    )
    parser.add_argument(
        "--model",
        choices=sorted(CONFIGS),
        default="a",
        help="model shape (benchmarks/_common.CONFIGS)",
    )
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        help="at most this many validation batches (default: the whole split)",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.data is None:
        parser.error(f"--data is required ({DEFAULT_DATA} does not exist)")
    text = args.data.read_text(encoding="utf-8")
    train_text, val_text = split_text(text, args.val_fraction)
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(
        f"data {args.data}: {len(train_text):,} train / {len(val_text):,} validation "
        f"characters; model {args.model} {CONFIGS[args.model]}; {args.batch_size} x "
        f"{args.block_size} tokens per step; {args.budget_s:g} s per run\n"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers: list[ByteTokenizer | HFTokenizer] = [ByteTokenizer()]
        for size in args.vocab:
            started = time.perf_counter()
            tokenizers.append(train_bpe([train_text], size))
            print(
                f"trained a BPE of {size} on the train split in "
                f"{time.perf_counter() - started:.1f} s",
                file=sys.stderr,
            )
        for i, tok in enumerate(tokenizers):
            rows.append(train_for(tok, train_text, val_text, args, Path(tmp) / str(i)))
            print(f"done: {rows[-1]['tokenizer']}", file=sys.stderr)
    headers = list(rows[0])
    print(format_table(headers, [[row[h] for h in headers] for row in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
