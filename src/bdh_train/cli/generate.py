"""`bdh-train generate` and `bdh-train chat`, and what every command that loads a checkpoint
shares (`eval` too): --checkpoint/--device/--threads, the sampling options, their checks and
the loading."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

from bdh_train.cli.args import DEVICES
from bdh_train.errors import BDHTrainError, ConfigError

if TYPE_CHECKING:  # the CLI imports torch and the model only when a command runs
    import torch

    from bdh_train.data.tokenizer import Tokenizer
    from bdh_train.model import BDH
    from bdh_train.model.summary import SummaryEvents

PROMPTS_BATCH_SIZE = 16
"""Rows `generate --prompts-file` runs together unless --batch-size says otherwise."""


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


def _check_save_state(args: argparse.Namespace) -> None:
    """--save-state under the output policy, checked before the model is loaded."""
    if args.save_state is not None:
        from bdh_train.storage.output import check_output

        check_output(args.save_state, "--save-state", force=args.force)


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


def _load_for_inference(args: argparse.Namespace, need_text: bool, finite: bool = False):
    """(model, tokenizer, config) of --checkpoint on --device with --threads set; with
    `finite` (commands that sample), weights holding NaN or infinity are refused."""
    _check_inference_args(args)

    from bdh_train.shared.loading import load_run
    from bdh_train.shared.threads import set_threads

    set_threads(args.threads)
    model, tok, cfg = load_run(args.checkpoint, device=args.device, finite=finite)
    if need_text and tok is None:
        raise BDHTrainError(
            f"{args.command} prints text: it needs a token-head model with a tokenizer (a "
            "byte-level model, vocab_size 256, or a run that carries its tokenizer.json)"
        )
    return model, tok, cfg


def _summary_events(model, cfg):
    """The run's summary trigger when the model's summary memory has a write gate."""
    return cfg.data.summary_trigger() if model.config.summary_memory.write_gate else None


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
    import torch

    from bdh_train.generation.chat import stop_token_ids

    _check_prompts_file_args(args)
    _check_save_state(args)
    model, tok, cfg = _load_for_inference(args, need_text=True, finite=True)
    events = _summary_events(model, cfg)
    generator = torch.Generator(device=model.embed.weight.device).manual_seed(args.seed)
    stops = stop_token_ids(args.stop, tok)
    if args.prompts_file is not None:
        return _generate_from_prompts_file(args, model, tok, events, generator, stops)
    if args.load_state is None and args.save_state is None:
        return _generate_in_one_call(args, model, tok, events, generator, stops)
    return _generate_with_state(args, model, tok, events, generator, stops)


def _generate_from_prompts_file(
    args: argparse.Namespace,
    model: BDH,
    tok: Tokenizer,
    events: SummaryEvents | None,
    generator: torch.Generator,
    stops: dict[int, str],
) -> int:
    """Print each prompt of --prompts-file with its completion, one JSON line each (ASCII:
    any other character escaped, whatever the terminal's encoding)."""
    from bdh_train.generation.completions import complete, read_prompts

    records = read_prompts(args.prompts_file, tok)
    for done in complete(
        model,
        tok,
        records,
        args.max_new_tokens,
        PROMPTS_BATCH_SIZE if args.batch_size is None else args.batch_size,
        temperature=args.temperature,
        top_k=args.top_k,
        generator=generator,
        stops=stops,
        summary_events=events,
    ):
        sys.stdout.write(json.dumps(done) + "\n")
        sys.stdout.flush()
    return 0


def _generate_in_one_call(
    args: argparse.Namespace,
    model: BDH,
    tok: Tokenizer,
    events: SummaryEvents | None,
    generator: torch.Generator,
    stops: dict[int, str],
) -> int:
    """--prompt continued by one sampling.stream_generate call (no state saved or loaded)."""
    import torch

    from bdh_train.generation.chat import until_stop
    from bdh_train.model import sampling
    from bdh_train.shared.loading import encode_text

    out = sys.stdout
    text = "\n" if args.prompt is None else args.prompt
    prompt = torch.tensor(
        encode_text(tok, text or "\n", "--prompt"),
        dtype=torch.long,
        device=model.embed.weight.device,
    )
    out.write(text)
    out.flush()
    stream = sampling.stream_generate(
        model,
        prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        generator,
        summary_events=events,
    )
    _stream_line(until_stop((int(token) for token in stream), stops), out, tok)
    return 0


def _generate_with_state(
    args: argparse.Namespace,
    model: BDH,
    tok: Tokenizer,
    events: SummaryEvents | None,
    generator: torch.Generator,
    stops: dict[int, str],
) -> int:
    """--prompt read into a Continuation (after --load-state's state, before --save-state),
    then sampled from it."""
    from bdh_train.generation.chat import until_stop
    from bdh_train.generation.continuation import Continuation
    from bdh_train.shared.loading import encode_text

    out = sys.stdout
    cont = Continuation(model, events)
    text = args.prompt if args.prompt is not None else ("" if args.load_state else "\n")
    if args.load_state is None:  # an empty prompt with nothing read before reads a newline
        text = text or "\n"
    ids = encode_text(tok, text, "--prompt")
    if args.load_state is not None:
        cont.load(args.load_state)
    cont.feed(ids)
    if args.save_state is not None:
        _save_state(cont, args.save_state, args.force)
    out.write(text)
    sampled = cont.sample(args.max_new_tokens, args.temperature, args.top_k, generator)
    _stream_line(until_stop(sampled, stops), out, tok)
    return 0


def _stream_line(tokens: Iterator[int], out: TextIO, tok: Tokenizer) -> None:
    """Write `tokens` as text as they come, then end the line, also when Ctrl-C stops the
    stream (the "interrupted" on stderr then starts a line of its own)."""
    from bdh_train.generation.chat import stream_text

    try:
        stream_text(tokens, out, tok)
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        raise
    out.write("\n")


def _save_state(cont, path: str, force: bool = False) -> None:
    """Save a Continuation's state to `path`, saying so on stderr."""
    saved = cont.save(path, force)
    print(f"saved the state after {cont.tokens_read} tokens to {saved}", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> int:
    import torch

    from bdh_train.generation.chat import chat, stop_token_ids
    from bdh_train.generation.continuation import Continuation

    _check_save_state(args)
    model, tok, cfg = _load_for_inference(args, need_text=True, finite=True)
    stops = stop_token_ids(args.stop, tok)
    cont = Continuation(model, _summary_events(model, cfg))
    if args.load_state is not None:
        cont.load(args.load_state)
    generator = torch.Generator(device=model.embed.weight.device).manual_seed(args.seed)
    terminal = sys.stdin.isatty() and not args.jsonl
    prompt = "> " if terminal else ""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    chat(
        cont,
        tok,
        sys.stdin,
        sys.stdout,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        generator,
        prompt=prompt,
        stops=stops,
        style="jsonl" if args.jsonl else "terminal" if terminal else "pipe",
    )
    if args.save_state is not None:
        _save_state(cont, args.save_state, args.force)
    return 0
