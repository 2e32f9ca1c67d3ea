"""`bdh-train prepare` throughput and memory: MB of text per second and peak RSS, for the byte
tokenizer and a byte-level BPE, at two corpus sizes.

Corpus: JSON lines of synthetic documents (50 to 2000 words each, a newline every ~12 words),
words drawn with a Zipf-like frequency from the vocabulary of --words-from (default
/work/shared/data/tinyshakespeare.txt when it exists, else a built-in list), seeded, so the
same sizes give the same files. The BPE (--bpe-vocab ids) is trained once, in this process, on
the first ~2 MB of the smallest corpus; its training is not measured.

Each measurement is one `bdh-train prepare CORPUS --out DIR --quiet` in a fresh subprocess
(Python start and imports included in its time). Peak RSS is that child's ru_maxrss, read
with os.wait4 (the per-child form of RUSAGE_CHILDREN, so runs do not mask each other). MB/s =
the corpus's text bytes (meta.json text_bytes, train + val) / wall seconds / 1e6; "MB/s
prepare" divides by the time the command itself reports (without Python start and imports,
which dominate small corpora). The goal:
>= 10 MB/s, peak RSS < 1 GiB and not growing with the corpus size.

Run: .venv/bin/python benchmarks/prepare.py [--sizes-mb 50 200] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from _common import machine_line, print_table

SHAKESPEARE = Path("/work/shared/data/tinyshakespeare.txt")
_COMMON_WORDS = (
    "the of and to in a is that for it as was with be by on not he I this are or his from at "
    "which but have an they you were her she there one all we their been has when who will "
    "more no if out so said what up its about into than them can only other new some time "
    "could these two may then do first any my now such like our over man me even most made "
    "after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three"
)
BUILTIN_WORDS = tuple(_COMMON_WORDS.split())
SRC = Path(__file__).resolve().parents[1] / "src"


def vocabulary(path: Path | None) -> list[str] | tuple[str, ...]:
    if path is not None and path.is_file():
        words = sorted(set(re.findall(r"[A-Za-z']+[,.;:!?]?", path.read_text("utf-8"))))
        if len(words) >= 100:
            return words
    return BUILTIN_WORDS


def write_corpus(path: Path, size_bytes: int, words: Sequence[str], seed: int = 0) -> int:
    """JSON lines of documents until `size_bytes` of text; returns the documents written."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, len(words) + 1, dtype=np.float64)
    probs = 1.0 / ranks
    probs /= probs.sum()
    order = rng.permutation(len(words))
    vocab = np.array(words, dtype=object)[order]
    written = docs = 0
    with open(path, "w", encoding="utf-8") as out:
        while written < size_bytes:
            n = int(rng.integers(50, 2000))
            picks = vocab[rng.choice(len(vocab), size=n, p=probs)]
            breaks = rng.random(n) < 1 / 12
            text = "".join(w + ("\n" if b else " ") for w, b in zip(picks, breaks, strict=True))
            text = text.strip() + "\n"
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            written += len(text.encode("utf-8"))
            docs += 1
    return docs


def train_tokenizer(corpus: Path, vocab: int, out_dir: Path) -> Path:
    sys.path.insert(0, str(SRC))
    from bdh_train.data.formats import iter_documents
    from bdh_train.data.tokenizer import train_bpe

    def sample():  # type: ignore[no-untyped-def]
        seen = 0
        for doc in iter_documents([corpus]):
            yield doc
            seen += len(doc)
            if seen > 2_000_000:
                return

    tok = train_bpe(sample(), vocab)
    out_dir.mkdir(parents=True, exist_ok=True)
    return tok.save(out_dir)


def measure(corpus: Path, out: Path, tokenizer: str) -> dict[str, float]:
    """One `bdh-train prepare` in a fresh process: wall seconds, peak RSS, text bytes."""
    cmd = [
        sys.executable,
        "-m",
        "bdh_train",
        "prepare",
        str(corpus),
        "--out",
        str(out),
        "--quiet",
        "--val-fraction",
        "0.01",
        "--tokenizer",
        tokenizer,
    ]
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
        stdout.seek(0)
        printed = stdout.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed ({proc.returncode}): {' '.join(cmd)}")
    inside = re.search(r"of text in ([0-9.]+)s", printed)
    meta = json.loads((out / "meta.json").read_text())
    text = sum(s["text_bytes"] for s in meta["splits"].values())
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    return {
        "seconds": seconds,
        "rss_mib": usage.ru_maxrss / 1024,
        "text_bytes": text,
        "tokens": tokens,
        "prepare_seconds": float(inside.group(1)) if inside else seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[50, 200])
    parser.add_argument("--bpe-vocab", type=int, default=4096)
    parser.add_argument("--words-from", type=Path, default=SHAKESPEARE)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the corpora and outputs")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    print(machine_line())
    words = vocabulary(args.words_from)
    print(f"words: {len(words)} ({'--words-from' if words is not BUILTIN_WORDS else 'built-in'})")
    try:
        corpora = {}
        for mb in args.sizes_mb:
            corpus = work / f"corpus-{mb:g}MB.jsonl"
            started = time.perf_counter()
            docs = write_corpus(corpus, int(mb * 1e6), words)
            corpora[mb] = corpus
            print(
                f"corpus {corpus.name}: {docs} documents, {corpus.stat().st_size / 1e6:.1f} "
                f"MB on disk, written in {time.perf_counter() - started:.1f}s",
                flush=True,
            )
        bpe = train_tokenizer(corpora[min(corpora)], args.bpe_vocab, work / "bpe")
        rows = []
        for mb, corpus in corpora.items():
            for name, tok in (("bytes", "bytes"), (f"bpe {args.bpe_vocab}", str(bpe))):
                out = work / f"out-{mb:g}-{name.split()[0]}"
                shutil.rmtree(out, ignore_errors=True)
                r = measure(corpus, out, tok)
                mb_text = r["text_bytes"] / 1e6
                rows.append(
                    [
                        f"{mb:g} MB",
                        name,
                        f"{mb_text:.1f}",
                        f"{r['tokens']:,}",
                        f"{r['seconds']:.2f}",
                        f"{mb_text / r['seconds']:.1f}",
                        f"{mb_text / r['prepare_seconds']:.1f}",
                        f"{r['rss_mib']:.0f}",
                    ]
                )
                if not args.keep:
                    shutil.rmtree(out, ignore_errors=True)
        print_table(
            "bdh-train prepare (one fresh process per row; seconds and MB/s include Python "
            "start and imports, 'MB/s prepare' is the command's own timing of the work)",
            [
                "corpus",
                "tokenizer",
                "text MB",
                "tokens",
                "seconds",
                "MB/s",
                "MB/s prepare",
                "peak RSS MiB",
            ],
            rows,
        )
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
