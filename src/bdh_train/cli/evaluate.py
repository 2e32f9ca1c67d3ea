"""`bdh-train eval`: validation loss and bits per byte of a checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bdh_train.cli.generate import _add_inference_args, _load_for_inference
from bdh_train.errors import BDHTrainError, ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="validation loss and bits per byte of a checkpoint")
    _add_inference_args(p)
    p.add_argument(
        "--data", default=None, help="held-out data source (default: the run's validation split)"
    )
    p.add_argument("--batches", type=int, default=None, help="at most this many batches")


def cmd_eval(args: argparse.Namespace) -> int:
    from bdh_train.data.config import is_text_of
    from bdh_train.data.tokenizer import BYTES, ByteTokenizer
    from bdh_train.train.evaluate import evaluate
    from bdh_train.train.step import LanguageTrainModel

    if args.batches is not None and args.batches < 1:
        raise ConfigError(
            f"--batches must be >= 1 (or left out for the whole split), got {args.batches}"
        )
    if Path(args.checkpoint).is_file() and not args.data:
        raise ConfigError(
            f"{args.checkpoint} is a ternary export, which holds no data settings: pass "
            "--data SOURCE"
        )
    model, tok, cfg = _load_for_inference(args, need_text=False)
    exported = Path(args.checkpoint).is_file()
    source = args.data or cfg.data.val_source or cfg.data.source
    if exported and tok is not None and tok.kind != BYTES and not source.endswith(".bin"):
        raise BDHTrainError(
            f"{args.checkpoint} is an export of a model with its own tokenizer: pass --data "
            "a .bin token file of that tokenizer, or eval the run directory, which encodes "
            "text with it"
        )
    t = cfg.training
    if args.data:
        data = cfg.data.load_source(args.data, cfg.model.vocab_size)
        data.validate_for_block(t.block_size, "eval data")
    else:
        _, data = cfg.data.load_splits(cfg.model.vocab_size, t.block_size)
        if data is None:
            raise ConfigError(
                "the run has no validation split (data.val_fraction = 0); pass --data SOURCE"
            )
    step = LanguageTrainModel(model, tbptt_chunk_size=t.tbptt_chunk_size)
    tok = tok if tok is not None else ByteTokenizer()  # the ids of a byte run's text are bytes
    text_of = tok if is_text_of(source, tok.kind == BYTES) else None
    result = evaluate(
        step,
        data,
        t.block_size,
        t.batch_size,
        args.batches,
        summary_trigger=cfg.data.summary_trigger(),
        device=model.embed.weight.device,
        byte_lengths=None if text_of is None else text_of.token_byte_lengths(),
        head=model.config.language_head,
    )
    print(json.dumps({**result.row(), "tokens": result.tokens}))
    return 0
