"""`bdh-train export`: a ternary file for inference, or a Hugging Face model directory."""

from __future__ import annotations

import argparse

from bdh_train.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument(
        "run_dir",
        nargs="?",
        metavar="RUN",
        help="a run directory, a checkpoint, or a ternary export file",
    )
    p.add_argument("out", nargs="?", metavar="OUT", help="the file --ternary writes")
    p.add_argument(
        "--checkpoint",
        metavar="RUN",
        help="RUN given as generate, eval and inspect take it (instead of the positional RUN)",
    )
    p.add_argument(
        "--force", action="store_true", help="--ternary: replace an existing OUT (a regular file)"
    )


def _run(args: argparse.Namespace) -> None:
    """RUN from the positional or from --checkpoint (then a lone positional is OUT)."""
    if args.checkpoint is None:
        if args.run_dir is None:
            raise ConfigError(
                "export needs RUN, a run directory, a checkpoint or a ternary file: give it "
                "as RUN or --checkpoint RUN"
            )
        return
    if args.out is not None:
        raise ConfigError(
            f"export got RUN twice: --checkpoint {args.checkpoint} and {args.run_dir}; give one"
        )
    args.run_dir, args.out = args.checkpoint, args.run_dir


def cmd_export(args: argparse.Namespace) -> int:
    _run(args)
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
    from bdh_train.export.ternary import export_run_ternary

    print(export_run_ternary(args.run_dir, args.out, force=args.force))
    return 0
