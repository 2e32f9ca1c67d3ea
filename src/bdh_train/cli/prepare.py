"""`bdh-train prepare`: tokenize corpora once into a directory training memory-maps;
`bdh-train corpus`: the built-in corpora, listed or written out as text files."""

from __future__ import annotations

import argparse
import time

from bdh_train.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize text corpora (.txt, .jsonl/.json, .parquet, .gz/.zst of them, "
        "directories, saved Hugging Face datasets) once into a directory training memory-maps",
    )
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="corpus files or directories")
    p.add_argument("--out", required=True, metavar="DIR", help="the prepared corpus directory")
    _add_tokenizer_args(p)
    _add_split_args(p)
    p.add_argument("--force", action="store_true", help="replace an existing prepared DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    c = sub.add_parser(
        "corpus", help="list the built-in corpora (builtin:NAME), or write one out as a text file"
    )
    c.add_argument("name", nargs="?", default=None, help="a built-in corpus (default: list them)")
    c.add_argument("--out", default=None, metavar="FILE", help="write NAME's text to FILE")
    c.add_argument("--force", action="store_true", help="replace an existing FILE")


def _add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    """--tokenizer, or --train-tokenizer with --vocab-size."""
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
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="ids of the BPE --train-tokenizer trains: 257 (the 256 bytes and the "
        "end-of-text token) or more; no default, the size is the caller's choice (e.g. 4096)",
    )


def _add_split_args(p: argparse.ArgumentParser) -> None:
    """--val-fraction or --val, and --text-field."""
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
    print(_prepared_line(args.out, meta, time.perf_counter() - started))
    return 0


def _prepared_line(out: str, meta: dict, seconds: float) -> str:
    """What prepare prints: each split's tokens and documents, the vocabulary, and the speed."""
    splits = ", ".join(
        f"{name} {counts['tokens']:,} tokens ({counts['documents']:,} documents)"
        for name, counts in meta["splits"].items()
    )
    text_mb = sum(counts["text_bytes"] for counts in meta["splits"].values()) / 1e6
    return (
        f"{out}: {splits}; vocab_size {meta['vocab_size']} ({meta['tokenizer']}); "
        f"{text_mb:.1f} MB of text in {seconds:.1f}s ({text_mb / max(seconds, 1e-9):.1f} MB/s)"
    )


def cmd_corpus(args: argparse.Namespace) -> int:
    from bdh_train.data.sources import BUILTIN_CORPORA, BUILTIN_PREFIX, write_builtin_corpus

    if args.name is None:
        for name, make in sorted(BUILTIN_CORPORA.items()):
            about = " ".join((make.__doc__ or "").split()).split(":")[0]
            print(f"{BUILTIN_PREFIX}{name:<12} {about}")
        return 0
    name = args.name.removeprefix(BUILTIN_PREFIX)
    if args.out is None:
        raise ConfigError(f"bdh-train corpus {args.name} needs --out FILE (where to write it)")
    size = write_builtin_corpus(name, args.out, args.force)
    print(f"{args.out}: {BUILTIN_PREFIX}{name}, {size:,} bytes of UTF-8 text")
    return 0
