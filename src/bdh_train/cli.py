"""`bdh-train`: train, generate, chat, eval, prepare, config, plot, profile, plan, export.

Every user error (bad config, data, checkpoint) is a BDHTrainError: printed as one line on
stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bdh_train import __version__
from bdh_train.errors import BDHTrainError, ConfigError

if TYPE_CHECKING:  # the CLI imports torch and the model only when a command runs
    import torch

    from bdh_train.data.tokenizer import Tokenizer
    from bdh_train.model import BDH
    from bdh_train.model.summary import SummaryEvents

EXIT_USER_ERROR = 2
EXIT_STOPPED = 75
"""A run stopped by SIGTERM or Ctrl-C after writing its checkpoint (resume it); 0 = finished."""


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
        help="CPU threads for torch, at most the machine's CPUs (0: torch's default)",
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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it is None/False or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        unset = default is None or default is False or default == []
        if unset or default == argparse.SUPPRESS or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


PROMPTS_BATCH_SIZE = 16
"""Rows `generate --prompts-file` runs together unless --batch-size says otherwise."""

DEVICES = ("auto", "cpu", "cuda")
"""--device choices: those of training.device (a test checks they agree; importing them would
import torch, which `--help` must not pay for)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bdh-train",
        description=__doc__.splitlines()[0],
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser = functools.partial(  # type: ignore[method-assign]
        sub.add_parser, formatter_class=_HelpFormatter
    )

    p = sub.add_parser("train", help="train a BDH (default: the tiny preset on builtin:pydoc)")
    _add_config_args(p)
    p.add_argument("--run-dir", default=None, help="run directory (default runs/<date-time>)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="continue a run exactly from its latest checkpoint (default: --run-dir)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start a fresh run in a run directory that holds an earlier one, deleting it",
    )
    p.add_argument(
        "--resume-fallback",
        action="store_true",
        help="with --resume: when the latest checkpoint is damaged, continue from the newest "
        "intact one",
    )

    p = sub.add_parser("generate", help="stream text from a checkpoint (O(1) per token)")
    _add_inference_args(p)
    p.add_argument(
        "--prompt",
        default=None,
        help="text to continue (default: a newline; with --load-state: nothing more)",
    )
    _add_sampling_args(p)
    p.add_argument(
        "--save-state",
        default=None,
        metavar="FILE",
        help="after reading the prompt, save the model's state (its size does not grow with "
        "the prompt) to FILE, to continue from later with --load-state",
    )
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

    p = sub.add_parser(
        "chat",
        help="type lines; each continues the same carried state, so a turn costs only its "
        "own tokens (Ctrl-D ends)",
    )
    _add_inference_args(p)
    _add_sampling_args(p)

    p = sub.add_parser("eval", help="validation loss and bits per byte of a checkpoint")
    _add_inference_args(p)
    p.add_argument(
        "--data", default=None, help="held-out data source (default: the run's validation split)"
    )
    p.add_argument("--batches", type=int, default=None, help="at most this many batches")

    p = sub.add_parser(
        "prepare",
        help="tokenize text corpora (.txt, .jsonl/.json, .parquet, .gz/.zst of them, "
        "directories, saved Hugging Face datasets) once into a directory training memory-maps",
    )
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="corpus files or directories")
    p.add_argument("--out", required=True, metavar="DIR", help="the prepared corpus directory")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="'bytes' or a Hugging Face tokenizer.json (or a directory holding one) "
        "(default: bytes)",
    )
    tok.add_argument(
        "--train-tokenizer",
        choices=("bpe",),
        default=None,
        help="train a byte-level BPE of --vocab-size ids on the training documents and store "
        "it in DIR",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="with --train-tokenizer")
    val = p.add_mutually_exclusive_group()
    val.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="about this share of the documents goes to validation, picked by a hash of "
        "their index (when that picks none: the last share of the tokens) "
        "(default: that of data.val_fraction)",
    )
    val.add_argument(
        "--val",
        nargs="+",
        default=None,
        metavar="SOURCE",
        help="validation sources instead of --val-fraction",
    )
    p.add_argument(
        "--text-field",
        default=None,
        help="the field of JSON lines, column of parquet files and saved datasets that holds "
        "the text (default: that of data.text_field)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing prepared DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

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

    p = sub.add_parser("plot", help="draw RUN_DIR/loss.png from metrics.jsonl")
    p.add_argument("run_dir")

    p = sub.add_parser(
        "profile",
        help="where a step's time goes (a table, and RUN_DIR/profile.png) from the profile rows "
        "of metrics.jsonl (train with training.profile = 'step' or 'detail')",
    )
    p.add_argument("run_dir")
    p.add_argument("--png", default=None, metavar="PATH", help="draw the bars to PATH instead")

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

    p = sub.add_parser("export", help="export a checkpoint for inference")
    p.add_argument(
        "--ternary",
        action="store_true",
        required=True,
        help="pack ternary (BitNet b1.58) weights 4 per byte",
    )
    p.add_argument("run_dir")
    p.add_argument("out")
    return parser


# ---------------------------------------------------------------------- commands
def cmd_train(args: argparse.Namespace) -> int:
    from bdh_train.config import load_train_config
    from bdh_train.distributed.env import DistContext, resolve_device
    from bdh_train.train.run_dir import RunDir
    from bdh_train.trainer import Trainer

    run, resume = RunDir.for_train(args.run_dir, args.resume)
    args.run = run  # an error is logged there once the command owns the directory
    cfg = load_train_config(run, resume, args.config, args.overrides, args.preset)
    dist_ctx = DistContext.from_env(
        resolve_device(cfg.training.device).type, cfg.parallel.collective_timeout_s
    )
    trainer = None
    try:
        trainer = Trainer(
            cfg,
            run,
            resume=resume,
            dist_ctx=dist_ctx,
            overwrite=args.overwrite,
            resume_fallback=args.resume_fallback,
        )
        with _stop_on_signals(trainer.request_stop):
            result = trainer.run()
    except BaseException as exc:
        # the traceback's frames (Trainer.run's `self` among them) would keep the trainer
        # alive past the collection below; the messages keep their files and lines
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        # The trainer sits in reference cycles, and its wrapped model (DDP's reducer, FSDP,
        # pipeline stages) holds the process group: left to the cycle collector, gloo's
        # group could be freed during interpreter shutdown, where a torchrun rank once
        # aborted ("terminate called without an active exception"). Freed here, the group
        # goes while the interpreter is whole, then is destroyed.
        trainer = None
        gc.collect()
        dist_ctx.close()
    return EXIT_STOPPED if result.stopped_early else 0


@contextlib.contextmanager
def _stop_on_signals(request_stop: Callable[[], None]) -> Iterator[None]:
    """SIGTERM and the first Ctrl-C ask the trainer to checkpoint at the next micro-step and
    return; a second Ctrl-C aborts at once."""
    interrupts = 0

    def on_interrupt(signum: int, frame: object) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:
            raise KeyboardInterrupt
        print("stopping at the next micro-step (Ctrl-C again to abort)", file=sys.stderr)
        request_stop()

    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: request_stop()),
        signal.SIGINT: signal.signal(signal.SIGINT, on_interrupt),
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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
    seed = getattr(args, "seed", 0)
    if not -(2**63) <= seed < 2**64:  # what torch.Generator.manual_seed takes
        raise ConfigError(f"--seed must be an integer from -2**63 to 2**64 - 1, got {seed}")


def _load_for_inference(args: argparse.Namespace, need_text: bool):
    """(model, tokenizer, config) of --checkpoint on --device with --threads set."""
    _check_inference_args(args)
    import torch

    from bdh_train.inference import load_run

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, cfg = load_run(args.checkpoint, device=args.device)
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
    from bdh_train.completions import complete, read_prompts

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


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from bdh_train.inference import (
        Continuation,
        encode_text,
        stop_token_ids,
        stream_text,
        until_stop,
    )

    _check_prompts_file_args(args)
    model, tok, cfg = _load_for_inference(args, need_text=True)
    events = _summary_events(model, cfg)
    device = model.embed.weight.device
    generator = torch.Generator(device=device).manual_seed(args.seed)
    stops = stop_token_ids(args.stop, tok)
    if args.prompts_file is not None:
        return _generate_from_prompts_file(args, model, tok, events, generator, stops)
    out = sys.stdout
    if args.load_state is None and args.save_state is None:  # one call: stream_generate
        text = "\n" if args.prompt is None else args.prompt
        prompt = torch.tensor(
            encode_text(tok, text or "\n", "--prompt"), dtype=torch.long, device=device
        )
        out.write(text)
        out.flush()
        stream = model.stream_generate(
            prompt,
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            generator,
            summary_events=events,
        )
        stream_text(until_stop((int(token) for token in stream), stops), out, tok)
        out.write("\n")
        return 0
    cont = Continuation(model, events)
    text = args.prompt if args.prompt is not None else ("" if args.load_state else "\n")
    if args.load_state is None:  # an empty prompt with nothing read before reads a newline
        text = text or "\n"
    ids = encode_text(tok, text, "--prompt")
    if args.load_state is not None:
        cont.load(args.load_state)
    cont.feed(ids)
    if args.save_state is not None:
        saved = cont.save(args.save_state)
        print(f"saved the state after {cont.tokens_read} tokens to {saved}", file=sys.stderr)
    out.write(text)
    sampled = cont.sample(args.max_new_tokens, args.temperature, args.top_k, generator)
    stream_text(until_stop(sampled, stops), out, tok)
    out.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    import torch

    from bdh_train.inference import Continuation, chat, stop_token_ids

    model, tok, cfg = _load_for_inference(args, need_text=True)
    stops = stop_token_ids(args.stop, tok)
    cont = Continuation(model, _summary_events(model, cfg))
    if args.load_state is not None:
        cont.load(args.load_state)
    generator = torch.Generator(device=model.embed.weight.device).manual_seed(args.seed)
    prompt = "> " if sys.stdin.isatty() else ""
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
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from bdh_train.data.tokenizer import BYTES, ByteTokenizer
    from bdh_train.train.build import build_evaluator, evaluation_data
    from bdh_train.train.step import LanguageTrainModel

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
    exported = Path(args.checkpoint).is_file()
    source = args.data or cfg.data.val_source or cfg.data.source
    if exported and tok is not None and tok.kind != BYTES and not source.endswith(".bin"):
        raise BDHTrainError(
            f"{args.checkpoint} is an export of a model with its own tokenizer: pass --data "
            "a .bin token file of that tokenizer, or eval the run directory, which encodes "
            "text with it"
        )
    t = cfg.training
    data = evaluation_data(cfg.data, args.data, cfg.model.vocab_size, t.block_size)
    step = LanguageTrainModel(model, tbptt_chunk_size=t.tbptt_chunk_size)
    tok = tok if tok is not None else ByteTokenizer()  # the ids of a byte run's text are bytes
    device = model.embed.weight.device
    evaluator = build_evaluator(
        step, data, source, args.batches, t, cfg.data, model.config, tok, device
    )
    result = evaluator.run()
    print(json.dumps({**result.row(), "tokens": result.tokens}))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from bdh_train.data.prepared import prepare_corpus
    from bdh_train.data.tokenizer import load_tokenizer

    if (args.train_tokenizer is None) != (args.vocab_size is None):
        raise ConfigError("--train-tokenizer bpe and --vocab-size N go together")
    given = {  # options left out take prepare_corpus's defaults
        key: value
        for key, value in (("val_fraction", args.val_fraction), ("text_field", args.text_field))
        if value is not None
    }
    started = time.perf_counter()
    meta = prepare_corpus(
        args.sources,
        args.out,
        tokenizer=None if args.tokenizer is None else load_tokenizer(args.tokenizer),
        train_bpe_vocab=args.vocab_size,
        val_sources=args.val,
        force=args.force,
        progress=not args.quiet,
        **given,
    )
    splits = ", ".join(
        f"{name} {counts['tokens']:,} tokens ({counts['documents']:,} documents)"
        for name, counts in meta["splits"].items()
    )
    seconds = time.perf_counter() - started
    text_mb = sum(counts["text_bytes"] for counts in meta["splits"].values()) / 1e6
    print(
        f"{args.out}: {splits}; vocab_size {meta['vocab_size']} ({meta['tokenizer']}); "
        f"{text_mb:.1f} MB of text in {seconds:.1f}s ({text_mb / max(seconds, 1e-9):.1f} MB/s)"
    )
    return 0


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
    from bdh_train.train.checkpoint import CHECKPOINTS

    source = Path(args.run_dir)
    if source.is_dir():  # load_run verifies the checkpoint; this only looks at paths
        kept = source / CHECKPOINTS if (source / CHECKPOINTS).is_dir() else source
        if Path(args.out).resolve().is_relative_to(kept.resolve()):
            raise ConfigError(
                f"OUT {args.out} is inside {kept}, the checkpoints it exports from, which it "
                "would damage; write the export outside it"
            )
    model, tok, _ = load_run(args.run_dir)
    tokenizer_json = tok.to_json() if isinstance(tok, HFTokenizer) else None
    print(export_ternary(model, args.out, tokenizer_json))
    return 0


COMMANDS = {
    "train": cmd_train,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "eval": cmd_eval,
    "prepare": cmd_prepare,
    "config": cmd_config,
    "plot": cmd_plot,
    "profile": cmd_profile,
    "plan": cmd_plan,
    "export": cmd_export,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.run = None
    try:
        return COMMANDS[args.command](args)
    except BDHTrainError as exc:
        message = f"error: {exc}"
        print(message, file=sys.stderr)
        if args.run is not None:
            args.run.log_error(message)
        return EXIT_USER_ERROR
    except OSError as exc:  # disk full, file size limit, read-only directory
        where = f": {exc.filename}" if exc.filename else ""
        message = f"error: {exc.strerror or exc}{where}"
        if args.run is not None:
            from bdh_train.train.checkpoint import io_advice

            message += f"; {io_advice(args.run.path)}"
        print(message, file=sys.stderr)
        if args.run is not None:
            args.run.log_error(message)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
