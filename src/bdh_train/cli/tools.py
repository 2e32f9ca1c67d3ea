"""The smaller commands: `config` (the resolved config, --explain), `plot` (loss curves),
`profile` (where a step's time goes) and `plan` (a pipeline schedule, or a step's memory)."""

from __future__ import annotations

import argparse

from bdh_train.cli.args import _add_config_args, check_output_option
from bdh_train.errors import BDHTrainError, ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    _register_config(sub)
    p = sub.add_parser(
        "plot",
        help="draw RUN_DIR/loss.png from metrics.jsonl; several runs: one chart of them all "
        "(--png PATH)",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    png = "one chart of the runs' train and validation losses (several runs, --x tokens)"
    p.add_argument("--png", default=None, metavar="PATH", help=png)
    p.add_argument(
        "--x", default="step", metavar="step|tokens", help="the chart's x axis (default: step)"
    )
    _add_png_force(p)

    p = sub.add_parser(
        "profile",
        help="where a step's time goes (a table, and RUN_DIR/profile.png) from the profile rows "
        "of metrics.jsonl (train with training.profile = 'step' or 'detail')",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    p.add_argument("--png", default=None, metavar="PATH", help="draw the bars to PATH instead")
    _add_png_force(p)
    _register_plan(sub)


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
        help="list every config key (or KEY: a key, section or table, or a word such as lr "
        "to search the key names) with its value under the preset, --config and --set "
        "(default preset: tiny), the dataclass default where it differs, the allowed values "
        "and the description",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="with --explain: the tables of docs/config.md",
    )


def _register_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="print a pipeline schedule's timeline and bubble, or (--memory) a train step's "
        "estimated peak memory",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="estimate the peak memory of one train step of the config (--config, --set, "
        "--preset) and compare it with what this process may use, as `train` does before "
        "it allocates anything",
    )
    _add_config_args(p)
    p.add_argument("--layers", type=int, help="the pipeline's layers (without --memory)")
    p.add_argument("--stages", type=int, help="pipeline stages (without --memory)")
    p.add_argument(
        "--virtual",
        type=int,
        default=1,
        help="virtual stages per rank (interleaved_1f1b; without --memory)",
    )
    p.add_argument("--microbatches", type=int, help="microbatches (without --memory)")
    p.add_argument("--schedule", default="gpipe", help="gpipe | 1f1b | interleaved_1f1b")
    p.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel replicas of the pipeline: show the N x stages process mesh",
    )
    p.add_argument("--png", default=None, metavar="PATH", help="also draw it to PATH")
    _add_png_force(p)


def _add_png_force(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--force", action="store_true", help="replace an existing --png PATH (a regular file)"
    )


def cmd_config(args: argparse.Namespace) -> int:
    if args.explain is not None:
        from bdh_train.config import load_config
        from bdh_train.config.explain import explain_markdown, explain_text

        if args.markdown and args.explain:
            raise ConfigError("--markdown lists every key; drop KEY from --explain")
        if args.markdown:
            print(explain_markdown(), end="")
            return 0
        cfg = load_config(args.config, args.overrides, args.preset)
        print(explain_text(args.explain, cfg), end="")
        return 0
    from bdh_train.config import dump_toml, load_config

    print(dump_toml(load_config(args.config, args.overrides, args.preset)), end="")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from bdh_train.storage.output import write_file
    from bdh_train.storage.run_dir import RunDir
    from bdh_train.train.metrics import plot_losses, plot_runs

    if args.png is None and (len(args.run_dirs) > 1 or args.x != "step"):
        what = f"{len(args.run_dirs)} runs" if len(args.run_dirs) > 1 else f"--x {args.x}"
        raise ConfigError(f"plot of {what} draws one chart of its own: give --png PATH")
    check_output_option(args.png, "--png", args.force)
    runs = [RunDir(path) for path in args.run_dirs]
    for run in runs:
        run.check_has_metrics()
    if args.png is None:
        print(plot_losses(runs[0].path))
        return 0
    chart = plot_runs([run.path for run in runs], args.x)
    print(write_file(args.png, chart, "--png", force=args.force))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from bdh_train.storage.run_dir import RunDir
    from bdh_train.train.metrics import read_metrics
    from bdh_train.train.profile import plot_profile, profile_rows, profile_table

    check_output_option(args.png or None, "--png", args.force)
    run = RunDir(args.run_dir)
    run.check_has_metrics()
    rows = profile_rows(read_metrics(run.metrics))
    if not rows:
        raise BDHTrainError(
            f"{run.metrics} has no profile rows: train with training.profile = 'step' or "
            "'detail' (or BDH_PROFILE=step in the environment)"
        )
    print(profile_table(rows))
    print(plot_profile(rows, args.png or run.profile_plot))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    pipeline = {
        "--layers": args.layers,
        "--stages": args.stages,
        "--microbatches": args.microbatches,
    }
    if args.memory:
        given = [name for name, value in pipeline.items() if value is not None]
        if given:
            raise ConfigError(f"plan --memory reads the run's config; drop {', '.join(given)}")
        from bdh_train.config import load_config
        from bdh_train.train.memory_check import plan_memory

        cfg = load_config(args.config, args.overrides, args.preset).resolved()
        print("\n".join(plan_memory(cfg.model, cfg.training, cfg.optimizer.name)))
        return 0
    if args.config or args.overrides or args.preset:
        raise ConfigError("--config, --set and --preset go with plan --memory")
    missing = [name for name, value in pipeline.items() if value is None]
    if missing:
        raise ConfigError(f"plan needs {', '.join(missing)} (or --memory)")
    check_output_option(args.png or None, "--png", args.force)
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
