"""The smaller commands: `config` (the resolved config, --explain), `plot` (loss curves),
`profile` (where a step's time goes), `plan` (a pipeline schedule) and `export` (a ternary
file for inference, or a Hugging Face model directory)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bdh_train.cli.args import _add_config_args
from bdh_train.errors import BDHTrainError, ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    _register_config(sub)
    p = sub.add_parser("plot", help="draw RUN_DIR/loss.png from metrics.jsonl")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")

    p = sub.add_parser(
        "profile",
        help="where a step's time goes (a table, and RUN_DIR/profile.png) from the profile rows "
        "of metrics.jsonl (train with training.profile = 'step' or 'detail')",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    p.add_argument("--png", default=None, metavar="PATH", help="draw the bars to PATH instead")
    _add_png_force(p)
    _register_plan(sub)

    p = sub.add_parser(
        "export",
        help="export a run, checkpoint or ternary export: packed ternary weights (--ternary "
        "RUN OUT) or a Hugging Face transformers model directory (--hf DIR RUN)",
    )
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument(
        "--ternary",
        action="store_true",
        help="pack ternary (BitNet b1.58) weights 4 per byte into the file OUT",
    )
    kind.add_argument(
        "--hf",
        metavar="DIR",
        help="write a new directory DIR that AutoModelForCausalLM.from_pretrained(DIR, "
        "trust_remote_code=True) and AutoTokenizer load with no bdh-train installed",
    )
    p.add_argument("run_dir", help="a run directory, a checkpoint, or a ternary export file")
    p.add_argument("out", nargs="?", help="the file --ternary writes")
    p.add_argument(
        "--force", action="store_true", help="--ternary: replace an existing OUT (a regular file)"
    )


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


def _check_png(args: argparse.Namespace) -> None:
    """--png under the output policy (never over a file without --force, never a device,
    link, run's file or checkpoint), before anything is computed."""
    if args.png:
        from bdh_train.storage.output import check_output

        check_output(args.png, "--png", force=args.force)


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
    from bdh_train.storage.run_dir import RunDir
    from bdh_train.train.metrics import plot_losses

    run = RunDir(args.run_dir)
    run.check_has_metrics()
    print(plot_losses(run.path))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from bdh_train.storage.run_dir import RunDir
    from bdh_train.train.metrics import read_metrics
    from bdh_train.train.profile import plot_profile, profile_rows, profile_table

    _check_png(args)
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
        return _plan_memory(args)
    if args.config or args.overrides or args.preset:
        raise ConfigError("--config, --set and --preset go with plan --memory")
    missing = [name for name, value in pipeline.items() if value is None]
    if missing:
        raise ConfigError(f"plan needs {', '.join(missing)} (or --memory)")
    _check_png(args)
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


def _plan_memory(args: argparse.Namespace) -> int:
    """`plan --memory`: the estimate, what this process may use, and whether it fits."""
    from bdh_train.config import load_config
    from bdh_train.distributed.env import resolve_device
    from bdh_train.train.allocator import resolve_host_allocator
    from bdh_train.train.memory_estimate import (
        available_memory,
        check_step_memory,
        estimate_step_memory,
        format_bytes,
        render_step_memory,
    )

    cfg = load_config(args.config, args.overrides, args.preset).resolved()
    t = cfg.training
    device = resolve_device(t.device)
    estimate = estimate_step_memory(cfg.model, t, device.type)
    print(render_step_memory(estimate, cfg.model, t, device.type))
    room = available_memory(device)
    if room.bytes < 0:
        print("this process's available memory is unknown here")
        return 0
    print(f"this process has {format_bytes(room.bytes)} available ({room.source})")
    try:
        check_step_memory(cfg.model, t, device, available=room)
        print("it fits")
    except ConfigError as exc:
        print(f"it does not fit: `bdh-train train` would refuse it ({exc})")
    if resolve_host_allocator(t.host_allocator, device, t.recompute != "none") == "retain":
        print(
            "training.host_allocator keeps freed memory in this process's heap here, so its "
            "resident set runs above the tensors' peak estimated here (docs/benchmarks.md, "
            '"Train-step memory")'
        )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.hf is not None:
        if args.out is not None:
            raise ConfigError(f"export --hf DIR takes one RUN; drop {args.out}")
        if args.force:
            raise ConfigError(
                "export --hf never replaces a directory; drop --force, name a new DIR"
            )
        from bdh_train.export.huggingface.writer import export_hf

        print(export_hf(args.run_dir, args.hf))
        return 0
    if args.out is None:
        raise ConfigError("export --ternary needs RUN and OUT, the file to write")
    from bdh_train.data.tokenizer import HFTokenizer
    from bdh_train.export.ternary import export_ternary
    from bdh_train.shared.loading import load_run
    from bdh_train.storage.output import check_output
    from bdh_train.storage.run_dir import check_outside_checkpoints

    check_outside_checkpoints(Path(args.run_dir), args.out)
    check_output(args.out, "OUT", force=args.force)
    model, tok, cfg = load_run(args.run_dir)
    tokenizer_json = tok.to_json() if isinstance(tok, HFTokenizer) else None
    training_json = json.dumps(cfg.to_dict()["training"])
    print(export_ternary(model, args.out, tokenizer_json, training_json, force=args.force))
    return 0
