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
    from bdh_train.data.tokenizer import BYTES
    from bdh_train.train.build import evaluate_model
    from bdh_train.train.evaluate import validation_source

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
    source = args.data or validation_source(cfg.data)
    if exported and tok is not None and tok.kind != BYTES and not source.endswith(".bin"):
        raise BDHTrainError(
            f"{args.checkpoint} is an export of a model with its own tokenizer: pass --data "
            "a .bin token file of that tokenizer, or eval the run directory, which encodes "
            "text with it"
        )
    result = evaluate_model(model, tok, cfg.training, cfg.data, args.data, args.batches)
    print(json.dumps({**result.row(), "tokens": result.tokens}))
    return 0
