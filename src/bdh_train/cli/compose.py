"""`bdh-train grow` (more neurons per head, the same function), `bdh-train merge` (models
joined along the neurons, with an optional short fine-tune) and `bdh-train import-official`
(a checkpoint of the official implementation as a checkpoint directory)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "grow",
        help="widen a trained model to M times its neurons per head, keeping its function; "
        "writes a checkpoint directory a new run starts from (--config OUT/config.toml)",
    )
    p.add_argument("--checkpoint", required=True, help="run or checkpoint directory to grow")
    p.add_argument(
        "--neurons-multiplier",
        type=int,
        required=True,
        metavar="M",
        help="the grown model's neurons per head: M times the source's (M >= 2)",
    )
    p.add_argument("--out", required=True, help="the new checkpoint directory (must not exist)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new neurons' weights")

    p = sub.add_parser(
        "merge",
        help="join models along the neurons, head by head, and report each source domain's "
        "loss; writes a checkpoint directory a new run starts from",
    )
    p.add_argument("sources", nargs="+", metavar="RUN", help="run or checkpoint directories")
    p.add_argument("--out", required=True, help="the new checkpoint directory (must not exist)")
    p.add_argument(
        "--embeddings",
        choices=("average", "first"),
        default="average",
        help="the dense tensors (embedding, head, norms): the sources' mean or the first's",
    )
    p.add_argument(
        "--finetune-steps",
        type=int,
        default=0,
        metavar="K",
        help="fine-tune the merged model for K steps of the first source's optimizer on --data "
        "(0: no fine-tune)",
    )
    p.add_argument(
        "--data",
        nargs="+",
        default=[],
        metavar="SOURCE",
        help="fine-tune data, mixed row by row (default: the sources' training splits)",
    )
    p.add_argument(
        "--freeze",
        default="",
        metavar="GROUPS",
        help="comma-separated parameter groups the fine-tune leaves alone (no gradient, no "
        "weight decay): embedding, normalization, output_head, shared_lowrank_encoder, "
        "shared_lowrank_decoder, shared_lowrank_decay, other_backbone (default: none)",
    )
    p.add_argument("--eval-batches", type=int, default=20, help="validation batches per domain")

    p = sub.add_parser(
        "import-official",
        help="turn a checkpoint of the official implementation (pathwaycom/bdh: a torch.save "
        "of its state_dict) into a checkpoint directory generate, eval, inspect and export "
        "read and a new run starts from (--config OUT/config.toml)",
    )
    p.add_argument("checkpoint", metavar="FILE", help="the official checkpoint (.pt)")
    p.add_argument(
        "--n-layer",
        type=int,
        required=True,
        metavar="L",
        help="the model's layers (the official weights are shared by every layer, so the "
        "file does not hold it; the official default is 6)",
    )
    p.add_argument("--out", required=True, help="the new checkpoint directory (must not exist)")


def cmd_grow(args: argparse.Namespace) -> int:
    from bdh_train.compose.grow import grow_run

    out = grow_run(args.checkpoint, args.neurons_multiplier, args.out, args.seed)
    print(f"grown x{args.neurons_multiplier}: {out} (train on: --config {out}/config.toml)")
    print(recipe_line(out))
    return 0


def cmd_import_official(args: argparse.Namespace) -> int:
    from bdh_train.compose.grow import import_official

    out = import_official(args.checkpoint, args.n_layer, args.out)
    print(f"imported: {out} (generate --checkpoint {out}; train on: --config {out}/config.toml)")
    return 0


def recipe_line(out: object) -> str:
    """The fine-tune recipe the written config holds, in words."""
    from bdh_train.compose.common import describe_recipe
    from bdh_train.config import load_config

    cfg = load_config([f"{out}/config.toml"], default_preset=False)
    return f"its config trains on with a fine-tune recipe: {describe_recipe(cfg.optimizer)}"


def cmd_merge(args: argparse.Namespace) -> int:
    from bdh_train.compose.merge import FinetuneConfig, merge_runs
    from bdh_train.errors import ConfigError

    if args.eval_batches < 1:
        raise ConfigError(f"--eval-batches must be >= 1, got {args.eval_batches}")
    freeze = [part for part in args.freeze.split(",") if part]
    finetune = FinetuneConfig(args.finetune_steps, args.data, freeze)
    report = merge_runs(
        args.sources, args.out, args.embeddings, finetune, args.eval_batches, sys.stderr
    )
    print(report.table())
    print(f"merged: {args.out} (train on: --config {args.out}/config.toml)")
    print(recipe_line(args.out))
    return 0
