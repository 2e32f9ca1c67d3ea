"""The smaller commands: `config` (the resolved config, --explain), `plot` (loss curves),
`profile` (where a step's time goes), `plan` (a pipeline schedule) and `export` (a ternary
file for inference)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bdh_train.cli.args import _add_config_args
from bdh_train.errors import BDHTrainError, ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    _register_config(sub)
    p = sub.add_parser("plot", help="draw RUN_DIR/loss.png from metrics.jsonl")
    p.add_argument("run_dir")

    p = sub.add_parser(
        "profile",
        help="where a step's time goes (a table, and RUN_DIR/profile.png) from the profile rows "
        "of metrics.jsonl (train with training.profile = 'step' or 'detail')",
    )
    p.add_argument("run_dir")
    p.add_argument("--png", default=None, metavar="PATH", help="draw the bars to PATH instead")
    _register_plan(sub)

    p = sub.add_parser("export", help="export a checkpoint for inference")
    p.add_argument(
        "--ternary",
        action="store_true",
        required=True,
        help="pack ternary (BitNet b1.58) weights 4 per byte",
    )
    p.add_argument("run_dir")
    p.add_argument("out")


def _register_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="print the fully resolved config, or (--explain) what every key means",
    )
    _add_config_args(p)
    p.add_argument(
        "--explain",
        nargs="?",
        const="",
        default=None,
        metavar="KEY",
        help="list every config key (or KEY, a section or table) with its default, allowed "
        "values and description",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="with --explain: the tables of docs/config.md",
    )


def _register_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print a pipeline schedule's timeline and bubble")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--virtual", type=int, default=1)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--schedule", default="gpipe", help="gpipe | 1f1b | interleaved_1f1b")
    p.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel replicas of the pipeline: show the N x stages process mesh",
    )
    p.add_argument("--png", default=None, metavar="PATH", help="also draw it to PATH")


def cmd_config(args: argparse.Namespace) -> int:
    if args.explain is not None:
        from bdh_train.config.explain import explain_markdown, explain_text

        if args.markdown and args.explain:
            raise ConfigError("--markdown lists every key; drop KEY from --explain")
        print(explain_markdown() if args.markdown else explain_text(args.explain), end="")
        return 0
    from bdh_train.config import dump_toml, load_config

    print(dump_toml(load_config(args.config, args.overrides, args.preset)), end="")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from bdh_train.train.metrics import METRICS_FILE, plot_losses

    if not (Path(args.run_dir) / METRICS_FILE).is_file():
        raise BDHTrainError(
            f"{Path(args.run_dir) / METRICS_FILE} does not exist: is "
            f"{args.run_dir} a run directory?"
        )
    print(plot_losses(Path(args.run_dir)))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from bdh_train.train.metrics import METRICS_FILE, read_metrics
    from bdh_train.train.profile import PROFILE_FILE, plot_profile, profile_rows, profile_table

    metrics = Path(args.run_dir) / METRICS_FILE
    if not metrics.is_file():
        raise BDHTrainError(f"{metrics} does not exist: is {args.run_dir} a run directory?")
    rows = profile_rows(read_metrics(metrics))
    if not rows:
        raise BDHTrainError(
            f"{metrics} has no profile rows: train with training.profile = 'step' or 'detail' "
            "(or BDH_PROFILE=step in the environment)"
        )
    print(profile_table(rows))
    print(plot_profile(rows, args.png or Path(args.run_dir) / PROFILE_FILE))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from bdh_train.distributed.planner import (
        build_pipeline_plan,
        plot_timeline,
        render_mesh,
        render_timeline,
    )

    plan = build_pipeline_plan(
        args.layers, args.stages, args.virtual, args.microbatches, args.schedule
    )
    print(render_mesh(args.data_parallel, args.stages))
    print(render_timeline(plan))
    if args.png:
        print(plot_timeline(plan, args.png))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from bdh_train.data.tokenizer import HFTokenizer
    from bdh_train.export import export_ternary
    from bdh_train.inference import load_run

    _refuse_out_inside_checkpoints(Path(args.run_dir), args.out)
    model, tok, _ = load_run(args.run_dir)
    tokenizer_json = tok.to_json() if isinstance(tok, HFTokenizer) else None
    print(export_ternary(model, args.out, tokenizer_json))
    return 0


def _refuse_out_inside_checkpoints(source: Path, out: str) -> None:
    """ConfigError when OUT lies inside the checkpoints export reads (a run directory's
    checkpoints folder, or the checkpoint directory given)."""
    from bdh_train.train.checkpoint import CHECKPOINTS

    if source.is_dir():  # load_run verifies the checkpoint; this only looks at paths
        kept = source / CHECKPOINTS if (source / CHECKPOINTS).is_dir() else source
        if Path(out).resolve().is_relative_to(kept.resolve()):
            raise ConfigError(
                f"OUT {out} is inside {kept}, the checkpoints it exports from, which it "
                "would damage; write the export outside it"
            )
