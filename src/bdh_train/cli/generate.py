"""`bdh-train generate` and `bdh-train chat`: their options, checked before the model is
loaded, and the call of the generation flow they run (`generation/flows.py`)."""

from __future__ import annotations

import argparse
import sys

from bdh_train.cli.args import (
    _add_inference_args,
    _add_sampling_args,
    _load_for_inference,
    _sampling,
    check_output_option,
)
from bdh_train.errors import ConfigError

PROMPTS_BATCH_SIZE = 16
"""Rows `generate --prompts-file` runs together unless --batch-size says otherwise."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream text from a checkpoint (O(1) per token)")
    _add_inference_args(p)
    p.add_argument(
        "--prompt",
        default=None,
        help="text to continue (default: a newline; with --load-state: nothing more)",
    )
    _add_sampling_args(p)
    _add_generate_output_args(p)

    p = sub.add_parser(
        "chat",
        help="type lines; each continues the same carried state, so a turn costs only its "
        "own tokens (Ctrl-D ends)",
    )
    _add_inference_args(p)
    _add_sampling_args(p)
    p.add_argument(
        "--save-state",
        default=None,
        metavar="FILE",
        help="when the conversation ends, save the model's state (everything read and "
        "replied) to FILE, to continue from later with --load-state",
    )
    p.add_argument(
        "--jsonl",
        action="store_true",
        help='print one JSON object a turn, {"turn", "input", "reply", "tokens", "stop", '
        '"cut"} (ASCII), instead of the replies as text (on a pipe each is followed by an '
        '"--- end of reply N ---" line, saying when the token limit cut it mid-word)',
    )
    _add_force_arg(p)


def _add_force_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --save-state FILE (only a regular file)",
    )


def _add_generate_output_args(p: argparse.ArgumentParser) -> None:
    """generate's --save-state, and --prompts-file with its --batch-size."""
    p.add_argument(
        "--save-state",
        default=None,
        metavar="FILE",
        help="after reading the prompt, save the model's state (its size does not grow with "
        "the prompt) to FILE, to continue from later with --load-state",
    )
    _add_force_arg(p)
    p.add_argument(
        "--prompts-file",
        default=None,
        metavar="FILE",
        help='complete many prompts: FILE holds one JSON object a line, {"prompt": "text"} '
        "(other keys are copied); prints each object as a JSON line with its "
        '"completion" and "stop" (the stop text it ended on, or null). Greedy completions '
        "are each prompt's alone; sampled ones depend on the batch",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"with --prompts-file: prompts generated together (each row's state is kept "
        f"in memory while its batch runs) (default: {PROMPTS_BATCH_SIZE})",
    )


def _check_prompts_file_args(args: argparse.Namespace) -> None:
    """Refuse options that do not combine with --prompts-file (or need it)."""
    if args.prompts_file is None:
        if args.batch_size is not None:
            raise ConfigError(
                "--batch-size applies to --prompts-file; add one or leave --batch-size out"
            )
        return
    for option, value in (
        ("--prompt", args.prompt),
        ("--load-state", args.load_state),
        ("--save-state", args.save_state),
    ):
        if value is not None:
            raise ConfigError(
                f"--prompts-file and {option} do not combine: the prompts come from the file "
                "(put this prompt in it as a line of its own)"
            )
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be a positive integer, got {args.batch_size}")


def cmd_generate(args: argparse.Namespace) -> int:
    from bdh_train.generation.flows import StateFiles, complete_prompts_file, continue_prompt

    _check_prompts_file_args(args)
    check_output_option(args.save_state, "--save-state", args.force)
    model, tok, cfg = _load_for_inference(args, need_text=True, finite=True)
    if args.prompts_file is not None:
        batch_size = PROMPTS_BATCH_SIZE if args.batch_size is None else args.batch_size
        draw = _sampling(args)
        complete_prompts_file(model, tok, cfg, draw, args.prompts_file, batch_size, sys.stdout)
        return 0
    states = StateFiles(args.load_state, args.save_state, args.force)
    continue_prompt(model, tok, cfg, _sampling(args), args.prompt, sys.stdout, states, sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from bdh_train.generation.flows import StateFiles, chat_session

    check_output_option(args.save_state, "--save-state", args.force)
    model, tok, cfg = _load_for_inference(args, need_text=True, finite=True)
    states = StateFiles(args.load_state, args.save_state, args.force)
    draw = _sampling(args)
    chat_session(model, tok, cfg, draw, sys.stdin, sys.stdout, states, args.jsonl, sys.stderr)
    return 0
