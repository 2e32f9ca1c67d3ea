"""`bdh-train eval`: validation loss and bits per byte of a checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bdh_train.cli.generate import _add_inference_args, _load_for_inference
from bdh_train.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="validation loss and bits per byte of a checkpoint")
    _add_inference_args(p)
    p.add_argument(
        "--data",
        default=None,
        help="held-out data source; a prepared corpus gives its validation split (default: "
        "the run's validation split)",
    )
    p.add_argument("--batches", type=int, default=None, help="at most this many batches")


def cmd_eval(args: argparse.Namespace) -> int:
    from bdh_train.train.build import evaluate_model

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
    result = evaluate_model(
        model, tok, cfg.training, cfg.data, args.data, args.batches, report=sys.stderr
    )
    print(json.dumps({**result.row(), "tokens": result.tokens}))
    return 0
