"""What the commands' parsers share: the parser (one-line refusals), the help formatter,
--device's choices, the config options (--config, --set, --preset) of `train` and `config`,
the options of every command that loads a checkpoint (generate, chat, eval, inspect:
--checkpoint/--device/--threads, the sampling options, their checks and the loading), and
the check of an output option (--save-state, --png) before anything is loaded or computed.

Importing this imports neither torch nor numpy: `bdh-train --help` builds every parser.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, NoReturn

from bdh_train.errors import BDHTrainError, ConfigError

if TYPE_CHECKING:  # the CLI imports torch and the model only when a command runs
    from bdh_train.generation.flows import Sampling

DEVICES = ("auto", "cpu", "cuda")
"""--device choices: those of training.device (a test checks they agree; importing them would
import torch, which `--help` must not pay for)."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it is None/False/empty or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        unset = default is None or default is False or default == [] or default == ""
        if unset or default == argparse.SUPPRESS or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose refusal is one `error:` line (what, which command, where its
    help is) and exit status 2, as every other refusal of bdh-train; argparse's own is the
    usage block, then the message."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"error: {self.prog}: {text}; see '{self.prog} --help'\n")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE.toml",
        help="config file (repeatable; later files override earlier ones)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="overrides",
        help="override one value, e.g. training.max_steps=30",
    )
    p.add_argument(
        "--preset",
        default=None,
        help="start from a preset: tiny | small | pathway (default: tiny when no --config)",
    )


def check_output_option(path: str | None, option: str, force: bool) -> None:
    """An output option's `path` (None: not given) under the output policy (never over a
    file without --force, never a device, link, run's file or checkpoint), checked before
    anything is loaded or computed."""
    if path is not None:
        from bdh_train.storage.output import check_output

        check_output(path, option, force=force)


# ------------------------------------------------- commands that load a checkpoint
def _add_inference_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="RUN_DIR",
        help="a run directory (its latest checkpoint), a checkpoint directory, or a "
        "`bdh-train export --ternary` file",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="where the model runs (auto: CUDA when available)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for torch, at most the machine's CPUs (0: the cores other work "
        "leaves free, as training.threads = 0)",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-new-tokens", type=int, default=200, help="tokens to generate (per turn in chat)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0 = greedy (always the most likely token)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="sample only from the k most likely tokens (default: all of them)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a completion (in chat, a reply) where it samples TEXT, which must be one "
        "token of the run's tokenizer; the stop is neither printed nor read into the state "
        "(repeatable)",
    )
    p.add_argument(
        "--load-state",
        default=None,
        metavar="FILE",
        help="continue from a state saved with generate --save-state (same model)",
    )


def _check_inference_args(args: argparse.Namespace) -> None:
    """Refuse bad sampling and thread values before anything is loaded."""
    if getattr(args, "max_new_tokens", 0) < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    temperature = getattr(args, "temperature", 0.0)
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(
            f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}"
        )
    top_k = getattr(args, "top_k", None)
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k must be a positive integer (or left out), got {top_k}")
    from bdh_train import checks  # numpy: not imported for --help

    checks.cpu_threads("--threads", args.threads)
    checks.seed("--seed", getattr(args, "seed", 0))


def _sampling(args: argparse.Namespace) -> Sampling:
    """The sampling options as the generation flows take them."""
    from bdh_train.generation.flows import Sampling

    return Sampling(args.max_new_tokens, args.temperature, args.top_k, args.seed, tuple(args.stop))


def _load_for_inference(
    args: argparse.Namespace, need_text: bool, finite: bool = False, reads: str | None = None
):
    """(model, tokenizer, config) of --checkpoint on --device with --threads set; with
    `finite` (commands that sample), weights holding NaN or infinity are refused. `reads`:
    what needs the text, for the refusal of a model without a tokenizer (default: the
    command prints text)."""
    _check_inference_args(args)

    from bdh_train.shared.loading import load_run
    from bdh_train.shared.threads import set_threads

    set_threads(args.threads)
    model, tok, cfg = load_run(args.checkpoint, device=args.device, finite=finite)
    if need_text and tok is None:
        on_mqar = reads is not None and cfg.data.source == "mqar"
        mqar = "; an MQAR run's memory is measured with eval --recall" if on_mqar else ""
        raise BDHTrainError(
            f"{reads or args.command + ' prints text'}: it needs a token-head model with a "
            "tokenizer (a byte-level model, vocab_size 256, or a run that carries its "
            f"tokenizer.json){mqar}"
        )
    return model, tok, cfg
