"""`bdh-train eval`: validation loss and bits per byte of a checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bdh_train.cli.args import _add_inference_args, _load_for_inference
from bdh_train.errors import ConfigError

T = TypeVar("T")


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
    _add_memory_args(p)


def _add_memory_args(p: argparse.ArgumentParser) -> None:
    """What the state remembers (bdh_train.evals.measures; docs/evaluation.md)."""
    g = p.add_argument_group("what the state remembers (instead of the loss)")
    g.add_argument(
        "--context-curve",
        action="store_true",
        help="loss by position with the state carried through sequences longer than the "
        "training block, against the same text in independent blocks (a table and a PNG)",
    )
    g.add_argument(
        "--retention",
        action="store_true",
        help="per chunk: loss after only the previous chunk, with the state carried from "
        "the start, and with a reset state",
    )
    g.add_argument(
        "--passkey",
        action="store_true",
        help="needle-in-a-haystack accuracy over needle depth x prompt length (a heat map)",
    )
    g.add_argument(
        "--length",
        type=int,
        default=None,
        help="context curve: tokens per sequence, a multiple of the training block "
        "(default: 16 blocks)",
    )
    g.add_argument("--sequences", type=int, default=4, help="context curve: sequences")
    g.add_argument("--chunks", type=int, default=8, help="retention: chunks of one block")
    g.add_argument(
        "--passkey-lengths",
        type=_comma_list(int, "integers", "512,1024"),
        default=None,
        metavar="L,L,...",
        help="prompt lengths in tokens (default: 1, 2, 4, 8 training blocks)",
    )
    g.add_argument(
        "--passkey-depths",
        type=_comma_list(float, "numbers", "0,0.5,1"),
        default=None,
        metavar="D,D,...",
        help="needle depths in [0, 1] (default: 0,0.25,0.5,0.75,1)",
    )
    g.add_argument("--passkey-trials", type=int, default=4, help="keys per grid cell")
    g.add_argument(
        "--recall",
        action="store_true",
        help="multi-query associative recall (MQAR) accuracy over pairs x example length, "
        "past the trained length too (a heat map)",
    )
    g.add_argument(
        "--recall-pairs",
        type=_comma_list(int, "integers", "4,8,16"),
        default=None,
        metavar="P,P,...",
        help="key-value pairs per example (default: data.mqar.pairs, its half and quarter)",
    )
    g.add_argument(
        "--recall-lengths",
        type=_comma_list(int, "integers", "128,256,512"),
        default=None,
        metavar="L,L,...",
        help="tokens per example (default: 1, 2, 4 x data.mqar.length)",
    )
    g.add_argument("--recall-examples", type=int, default=32, help="examples per grid cell")
    g.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where the JSON and PNG files go (default: evals/RUN_NAME in the working directory)",
    )
    g.add_argument("--force", action="store_true", help="replace earlier result files in --out DIR")


def _comma_list(cast: Callable[[str], T], what: str, example: str) -> Callable[[str], list[T]]:
    """An argparse type: a comma-separated list of `what` (argparse names the option when the
    text is not one)."""

    def parse(text: str) -> list[T]:
        try:
            return [cast(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"a comma-separated list of {what}, e.g. {example}, got {text!r}"
            ) from None

    return parse


def cmd_eval(args: argparse.Namespace) -> int:
    if args.context_curve or args.retention or args.passkey or args.recall:
        return _memory_evals(args)
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


def _memory_evals(args: argparse.Namespace) -> int:
    """eval --context-curve / --retention / --passkey / --recall: each option checked before
    loading."""
    from bdh_train.evals.measures import MemoryEvals, run_memory_evals
    from bdh_train.storage.places import results_dir

    options = MemoryEvals(
        context_curve=args.context_curve,
        retention=args.retention,
        passkey=args.passkey,
        length=args.length,
        sequences=args.sequences,
        chunks=args.chunks,
        passkey_lengths=args.passkey_lengths,
        passkey_depths=args.passkey_depths,
        passkey_trials=args.passkey_trials,
        recall=args.recall,
        recall_pairs=args.recall_pairs,
        recall_lengths=args.recall_lengths,
        recall_examples=args.recall_examples,
        out=results_dir(args.checkpoint) if args.out is None else Path(args.out),
        force=args.force,
    )
    options.check()
    if Path(args.checkpoint).is_file() and not args.data and options.reads_data:
        raise ConfigError(
            f"{args.checkpoint} is a ternary export, which holds no data settings: pass "
            "--data SOURCE"
        )
    need_text = options.passkey or options.reads_data
    reads = "--context-curve and --retention read text, --passkey writes it"
    model, tok, cfg = _load_for_inference(args, need_text=need_text, finite=True, reads=reads)
    for line in run_memory_evals(model, tok, cfg, args.data, options):
        print(line)
    return 0
