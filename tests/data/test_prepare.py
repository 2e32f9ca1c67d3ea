"""`bdh-train prepare` and the prepared corpus: exact round trips, byte-identical reruns, the
validation rule, atomic refusal of bad input, and a reader that trusts no size in meta.json."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from test_formats import DOCS, write_all_formats

from bdh_train.cli import main
from bdh_train.config import load_config
from bdh_train.data import DataConfig, load_splits, load_tokens
from bdh_train.data.layout import META_FILE, in_validation, is_prepared
from bdh_train.data.prepared import load_prepared, prepare_corpus, read_meta
from bdh_train.data.tokenizer import load_tokenizer, train_bpe
from bdh_train.errors import DataError
from bdh_train.training.trainer import Trainer

CORPUS = [
    f"Document {i}: {' '.join(['the quick brown fox', 'jumps over', 'the lazy dog'][: i % 3 + 1])}"
    f"\n{'Grüße 世界 🐉 ' * (i % 4)}end {i}.\n"
    for i in range(40)
]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def documents_of(data, tokenizer) -> list[str]:  # type: ignore[no-untyped-def]
    """Each document's text, cut at doc_starts, without the end-of-document token."""
    starts = [int(s) for s in data.doc_starts] + [len(data)]
    docs = []
    for a, b in zip(starts, starts[1:], strict=False):
        ids = data.tokens[a:b].tolist()
        if tokenizer.eot_id is not None:
            assert ids[-1] == tokenizer.eot_id
            ids = ids[:-1]
        docs.append(tokenizer.decode_bytes(ids).decode("utf-8"))
    return docs


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_trained_bpe_round_trips_every_document(tmp_path: Path, capsys) -> None:
    # Validation documents carry a word no training document has.
    corpus = [d + " qqqqqqqq" * 20 if in_validation(i, 0.2) else d for i, d in enumerate(CORPUS)]
    assert len(train_bpe(corpus, 320).encode("qqqqqqqq")) < 8  # trained on all: "qq" merges
    source = write_jsonl(tmp_path / "c.jsonl", corpus)
    out = tmp_path / "prep"
    assert (
        main(
            [
                "prepare",
                str(source),
                "--out",
                str(out),
                "--train-tokenizer",
                "bpe",
                "--vocab-size",
                "320",
                "--val-fraction",
                "0.2",
                "--quiet",
            ]
        )
        == 0
    )
    assert "train" in capsys.readouterr().out
    meta = json.loads((out / META_FILE).read_text())
    tok = load_tokenizer(out)
    assert meta["tokenizer"] == "tokenizer.json" and meta["tokenizer_sha256"] == tok.fingerprint()
    assert meta["vocab_size"] == tok.vocab_size == 320 and meta["eot_id"] == tok.eot_id
    train, val = load_prepared(out, tokenizer=tok)
    assert isinstance(train.tokens, np.memmap) and isinstance(train.doc_starts, np.memmap)
    want_val = [d for i, d in enumerate(corpus) if in_validation(i, 0.2)]
    assert 0 < len(want_val) < len(corpus) and meta["val_rule"] == "documents"
    assert documents_of(train, tok) == [d for d in corpus if d not in want_val]
    assert documents_of(val, tok) == want_val
    for name, data in (("train", train), ("val", val)):
        counts = meta["splits"][name]
        assert counts["tokens"] == len(data)
        assert counts["documents"] == len(data.doc_starts)
        text = documents_of(data, tok)
        assert counts["text_bytes"] == sum(len(d.encode()) for d in text)
    assert len(tok.encode("qqqqqqqq")) == 8  # the tokenizer saw the training documents only
    assert val.eot_id == tok.eot_id and not train.byte_level


def test_prepare_is_byte_identical_across_runs(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", CORPUS)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        prepare_corpus([source], out, train_bpe_vocab=300, val_fraction=0.3, progress=False)
    first, second = (files_of(o) for o in outs)
    assert sorted(first) == [
        "meta.json",
        "tokenizer.json",
        "train.bin",
        "train.idx.npy",
        "val.bin",
        "val.idx.npy",
    ]
    assert first == second
    assert str(tmp_path) not in first["meta.json"].decode().replace(str(source), "")


def test_every_format_prepares_to_the_same_files(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    sources = write_all_formats(tmp_path / "src", DOCS)
    bpe = train_bpe(DOCS, 300)
    expected = None
    for i, (name, path) in enumerate(sources.items()):
        out = tmp_path / f"out{i}"
        prepare_corpus([path], out, tokenizer=bpe, val_fraction=0.5, progress=False)
        got = {k: v for k, v in files_of(out).items() if k != META_FILE}
        meta = json.loads((out / META_FILE).read_text())
        got["splits"] = json.dumps(meta["splits"]).encode()
        if expected is None:
            expected = got
        assert got == expected, name


def test_single_document_splits_like_training_does(tmp_path: Path) -> None:
    """A corpus of one document still gets validation: its last val_fraction of tokens, the
    same cut `data.val_fraction` makes when training on the text directly."""
    text = tmp_path / "one.txt"
    text.write_text("".join(CORPUS), encoding="utf-8")
    out = tmp_path / "prep"
    meta = prepare_corpus([text], out, val_fraction=0.1, progress=False)
    assert meta["val_rule"] == "tail"
    train, val = load_splits(str(out), 256, block_size=8)
    direct_train, direct_val = load_splits(str(text), 256, block_size=8, val_fraction=0.1)
    assert train.tokens.tolist() == direct_train.tokens.tolist()
    assert val.tokens.tolist() == direct_val.tokens.tolist()
    assert train.doc_starts.tolist() == [0] and val.doc_starts.tolist() == [0]
    assert train.byte_level and val.byte_level
    assert meta["splits"]["val"]["text_bytes"] == len(val)


def test_validation_choice_order(tmp_path: Path) -> None:
    """val_source wins over a prepared validation split, which wins over val_fraction."""
    source = write_jsonl(tmp_path / "c.jsonl", CORPUS)
    other = tmp_path / "other.txt"
    other.write_text("a separate validation text, long enough for a block")
    out = tmp_path / "prep"
    prepare_corpus([source], out, val_sources=[other], progress=False)
    _, val = load_splits(str(out), 256, 8, val_fraction=0.5)
    assert val.tokens.tolist() == list(other.read_bytes())
    cfg = DataConfig(source=str(out), val_source=str(out / "train.bin"), val_fraction=0.5)
    train, val = cfg.load_splits(256, 8)
    assert val.tokens.tolist() == train.tokens.tolist()
    assert load_tokens(str(out / "val.bin")).tokens.tolist() == list(other.read_bytes())
    (out / "val.bin").write_bytes(b"damaged")  # unused with a val_source: not read
    _, val = load_splits(str(out), 256, 8, val_source=str(other))
    assert val.tokens.tolist() == list(other.read_bytes())
    with pytest.raises(DataError, match=r"val.bin' has 7 bytes"):
        load_splits(str(out), 256, 8)
    (out / "val.bin").write_bytes(other.read_bytes())
    assert DataConfig(source=str(out / "val.bin")).is_byte_text
    assert DataConfig(source=str(out)).is_byte_text
    assert not DataConfig(source=str(out / "val.bin"), tokenizer="x.json").is_byte_text
    (tmp_path / "val.bin").write_bytes((out / "val.bin").read_bytes())
    assert not DataConfig(source=str(tmp_path / "val.bin")).is_byte_text


def test_headerless_bin_loads_with_bin_dtype(tmp_path: Path) -> None:
    """A nanoGPT-style .bin without a header: refused without data.bin_dtype (the message
    names it); with it, the splits training reads are the file's ids."""
    ids = (np.arange(3000) * 7 % 200).astype(np.uint16)
    path = tmp_path / "train.bin"
    path.write_bytes(ids.tobytes())
    with pytest.raises(DataError, match=r"no header .*set data.bin_dtype"):
        DataConfig(source=str(path)).load_splits(256, 8)
    cfg = DataConfig(source=str(path), bin_dtype="uint16", val_fraction=0.1)
    train, val = cfg.load_splits(256, 8)
    assert train.tokens.tolist() + val.tokens.tolist() == ids.tolist()
    assert len(val) == 300 and not train.byte_level
    data = cfg.load_source(str(path), 256)
    assert data.tokens.tolist() == ids.tolist() and not data.byte_level
    with pytest.raises(DataError, match=r"token id 154 at position 22 .* >= vocab_size 150"):
        cfg.load_source(str(path), 150)
    # and it trains: one step of a tiny model on it, no sidecar written
    settings = [
        "model.n_layer=1",
        "model.n_embd=16",
        "model.n_head=2",
        "model.mlp_internal_dim_multiplier=2",
        "training.block_size=8",
        "training.batch_size=2",
        "training.max_steps=1",
        "training.eval_every=0",
        f"data.source='{path}'",
        "data.bin_dtype='uint16'",
    ]
    result = Trainer(load_config(overrides=settings), tmp_path / "run", stream=io.StringIO()).run()
    assert result.step == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["run", "train.bin"]


def test_binary_source_is_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    good = write_jsonl(tmp_path / "c.jsonl", CORPUS)
    blob = tmp_path / "blob.dat"
    blob.write_bytes(bytes(range(256)))
    out = tmp_path / "out" / "prep"
    assert main(["prepare", str(good), str(blob), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "blob.dat' is not UTF-8" in err
    assert not (tmp_path / "out").exists()


def test_a_bpe_vocabulary_too_large_to_train_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys
) -> None:
    """The tokenizers trainer allocates for every id up front (100e9 ids aborted the process
    and left the temporary output behind); the size is refused before anything is made."""
    source = tmp_path / "a.txt"
    source.write_text("hello world\n")
    out = tmp_path / "made" / "o"
    args = ["prepare", str(source), "--out", str(out), "--quiet", "--train-tokenizer", "bpe"]
    assert main([*args, "--vocab-size", "100000000000"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: a byte-level BPE needs a vocab_size (--vocab-size) from 257 ")
        and "to 1,048,576, got 100000000000" in err
        and err.count("\n") == 1
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_existing_output_needs_force(tmp_path: Path, capsys) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", CORPUS[:5])
    out = tmp_path / "prep"
    assert main(["prepare", str(source), "--out", str(out), "--quiet"]) == 0
    before = files_of(out)
    source.write_text(json.dumps({"text": "changed"}) + "\n")
    assert main(["prepare", str(source), "--out", str(out), "--quiet"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert files_of(out) == before
    assert main(["prepare", str(source), "--out", str(out), "--quiet", "--force"]) == 0
    train, val = load_prepared(out)
    assert bytes(train.tokens.tolist() + val.tokens.tolist()) == b"changed"
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    assert main(["prepare", str(source), "--out", str(precious), "--quiet", "--force"]) == 2
    assert "not a prepared corpus" in capsys.readouterr().err
    assert (precious / "keep.txt").read_text() == "mine"
    (precious / "meta.json").write_text('{"title": "some other tool"}')
    (precious / "train.bin").write_bytes(b"also mine")
    assert main(["prepare", str(source), "--out", str(precious), "--quiet", "--force"]) == 2
    assert "not a prepared corpus (its meta.json is not" in capsys.readouterr().err
    (out / "notes.md").write_text("a file prepare never writes")  # a real meta.json beside it
    assert main(["prepare", str(source), "--out", str(out), "--quiet", "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(it also holds 'notes.md')" in err
    assert (out / "notes.md").read_text() == "a file prepare never writes"
    assert (precious / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "precious", "prep"]
    assert main(["prepare", str(out), "--out", str(tmp_path / "again"), "--quiet"]) == 2
    assert "is a corpus `bdh-train prepare` wrote (tokens, not text)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda m: m["splits"]["train"].update(tokens=10**15), r"train.bin' has \d+ bytes, but"),
        (lambda m: m["splits"]["train"].update(documents=7), r"train.idx.npy' holds uint64"),
        (lambda m: m.update(dtype="uint32"), r"train.bin' has \d+ bytes, but meta.json says"),
        (lambda m: m.update(vocab_size=-1), r"vocab_size -1 is not a positive integer"),
        (lambda m: m.update(version=99), r"format version 99"),
        (lambda m: m["splits"].update(test={}), r"'splits' must hold 'train'"),
    ],
)
def test_meta_that_disagrees_with_the_files_is_refused_before_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit, expected
) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", CORPUS[:6])
    out = tmp_path / "prep"
    prepare_corpus([source], out, val_fraction=0, progress=False)
    meta = json.loads((out / META_FILE).read_text())
    edit(meta)
    (out / META_FILE).write_text(json.dumps(meta))

    def no_mapping(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a file was mapped before its size was checked")

    monkeypatch.setattr(np, "memmap", no_mapping)
    with pytest.raises(DataError, match=expected):
        load_prepared(out)


@pytest.mark.parametrize(
    "text, why",
    [
        (
            '{"format": "bdh-train prepared corpus", "n": ' + "9" * 5000 + "}",
            "Exceeds the limit (4300 digits)",
        ),
        ("[" * 100_000 + "]" * 100_000, "maximum recursion depth"),
    ],
    ids=["digits", "nesting"],
)
def test_a_meta_json_too_deep_or_too_long_to_parse_is_one_error(tmp_path: Path, text, why):
    (tmp_path / META_FILE).write_text(text)
    assert not is_prepared(tmp_path)
    with pytest.raises(DataError) as refused:
        read_meta(tmp_path)
    assert str(refused.value).startswith(f"'{tmp_path / META_FILE}' is not valid JSON ({why}")


def test_damaged_index_and_wrong_tokenizer_are_refused(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", CORPUS[:6])
    out = tmp_path / "prep"
    prepare_corpus([source], out, val_fraction=0, progress=False)
    bpe = train_bpe(CORPUS, 300)
    with pytest.raises(
        DataError,
        match=r"tokenized with the byte tokenizer .* data.tokenizer = "
        r"'bytes'",
    ):
        load_prepared(out, tokenizer=bpe)
    saved = bpe.save(tmp_path / "bpe")
    with pytest.raises(DataError, match=r"tokenized with the byte tokenizer"):
        DataConfig(source=str(out), tokenizer=str(saved)).load_splits(256, 8)
    index = out / "train.idx.npy"
    starts = np.load(index)
    starts[2] = starts[1]
    np.save(index, starts)
    with pytest.raises(DataError, match=r"document starts are not increasing"):
        load_prepared(out)


def test_documents_that_encode_to_nothing_are_no_documents(tmp_path: Path) -> None:
    """A document whose text has no ids under the tokenizer (a BPE without an unknown token
    drops characters outside its vocabulary) gets no start and no end-of-document id, so the
    corpus prepare writes always loads; a tokenizer with neither an end-of-document id nor
    ids for a newline is refused."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, trainers

    from bdh_train.data.tokenizer import HFTokenizer

    def bpe(special: list[str], pre=None) -> HFTokenizer:  # type: ignore[no-untyped-def]
        hf = HF(models.BPE())
        if pre is not None:
            hf.pre_tokenizer = pre
        hf.train_from_iterator(
            ["ab ba\n"] * 4,
            trainers.BpeTrainer(vocab_size=20, special_tokens=special, show_progress=False),
        )
        return HFTokenizer(hf)

    source = write_jsonl(tmp_path / "c.jsonl", ["ab ab", "zzz", "ba", "zz"])
    for i, tok in enumerate((bpe([]), bpe(["</s>"]))):
        assert tok.encode("zzz") == []
        out = tmp_path / f"prep{i}"
        meta = prepare_corpus([source], out, tokenizer=tok, val_fraction=0, progress=False)
        assert meta["splits"]["train"]["documents"] == 2
        train, _ = load_prepared(out, tokenizer=tok)
        first, second = tok.encode("ab ab"), tok.encode("ba")
        between = [tok.eot_id] if tok.eot_id is not None else tok.encode("\n")
        end = [tok.eot_id] if tok.eot_id is not None else []
        assert train.tokens.tolist() == first + between + second + end
        assert train.doc_starts.tolist() == [0, len(first) + len(between)]
    no_newline = bpe([], pre_tokenizers.Whitespace())
    assert no_newline.eot_id is None and no_newline.encode("\n") == []
    with pytest.raises(
        DataError,
        match=r"no end-of-document token .* encodes a newline to "
        r"nothing",
    ):
        prepare_corpus([source], tmp_path / "bad", tokenizer=no_newline, progress=False)
    assert not (tmp_path / "bad").exists()


def test_failed_rename_keeps_the_previous_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from bdh_train.data import prepared

    source = write_jsonl(tmp_path / "c.jsonl", CORPUS[:5])
    out = tmp_path / "prep"
    prepare_corpus([source], out, progress=False)
    before = files_of(out)
    rename = os.replace

    def failing(src, dst):  # type: ignore[no-untyped-def]
        if Path(src).name.startswith(".prep.tmp-"):
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(prepared.os, "replace", failing)
    with pytest.raises(DataError, match=r"cannot move .*No space left.*previous one is left"):
        prepare_corpus([source], out, force=True, val_fraction=0.5, progress=False)
    assert files_of(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "prep"]


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda meta: meta.write_text('{"format": "bdh-train prep'), "is not valid JSON ("),
        (lambda meta: meta.unlink(), None),
        (lambda meta: (meta.unlink(), meta.mkdir()), "is a directory, not a regular file"),
        (lambda meta: meta.write_text("[1, 2]"), "is not the meta of a bdh-train prepared"),
    ],
    ids=["torn", "missing", "a directory", "not its meta"],
)
def test_a_prepared_corpus_with_a_damaged_meta_is_one_to_prepare_again(
    tmp_path: Path, capsys, damage, problem
) -> None:
    """A directory holding the prepared layout's training files reads as a damaged prepared
    corpus, whatever its meta.json is: as data.source (the directory or its train.bin) it is
    refused with what is wrong and "prepare the corpus again", not read as text; inside a
    corpus directory it is skipped (tokens, not text); --force replaces it."""
    source = write_jsonl(tmp_path / "c.jsonl", CORPUS[:6])
    out = tmp_path / "prep"
    prepare_corpus([source], out, progress=False)
    meta = out / META_FILE
    damage(meta)
    problem = problem or "No such file or directory"
    redo = f"prepare the corpus again with `bdh-train prepare ... --out {out} --force`"
    for name in (out, out / "train.bin"):
        with pytest.raises(DataError) as refused:
            load_splits(str(name), 256, 8)
        message = str(refused.value)
        assert f"'{meta}'" in message and problem in message and message.endswith(redo)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text, long enough to train on" * 4)
    out.rename(corpus / "prep")
    assert bytes(load_tokens(str(corpus)).tokens.tolist()) == (corpus / "a.txt").read_bytes()
    (corpus / "prep").rename(out)
    capsys.readouterr()
    assert main(["prepare", str(source), "--out", str(out), "--quiet", "--force"]) == 0
    assert load_prepared(out)[0].tokens.size > 0


@pytest.mark.timeout(180)
def test_a_killed_prepare_leaves_a_temporary_the_next_removes_and_a_live_one_is_kept(
    tmp_path: Path, capsys
) -> None:
    """A `bdh-train prepare` whose writing never ends (its corpus writer blocks; a FIFO as
    the source would be refused) waits, alive, inside its temporary: another prepare of the
    same output keeps that temporary (its writer holds a flock on it) and removes one left by
    a killed writer (no lock: partial data in the files prepare writes). Once the waiting
    prepare is killed (SIGKILL: nothing of it runs after), the next prepare removes its
    temporary too. A hidden directory of the same name pattern holding a file prepare never
    writes is someone else's, and is kept."""
    import os
    import signal
    import subprocess
    import sys
    import time

    source = write_jsonl(tmp_path / "c.jsonl", CORPUS[:5])
    out = tmp_path / "prep"
    blocks = (
        "import sys, time; from bdh_train.data import prepared; "
        "prepared._write_corpus = lambda *a, **k: time.sleep(3600); "
        "from bdh_train.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", blocks, "prepare", str(source), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (live := sorted(tmp_path.glob(".prep.tmp-*"))):
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        (live,) = live
        dead = tmp_path / ".prep.tmp-killed1"  # as a killed prepare leaves it
        dead.mkdir()
        (dead / "train.bin").write_bytes(b"\x01\x00" * 100)
        (dead / "train.idx.raw").write_bytes(bytes(8))
        (dead / "val.bin").write_bytes(b"")
        foreign = tmp_path / ".prep.tmp-notes"
        foreign.mkdir()
        (foreign / "notes.txt").write_text("mine")
        capsys.readouterr()
        assert main(["prepare", str(source), "--out", str(out), "--quiet"]) == 0
        notice = f"left by a `bdh-train prepare` of '{out}' that did not finish"
        assert capsys.readouterr().err == f"notice: removed '{dead}', {notice}\n"
        assert not dead.exists() and live.is_dir() and writer.poll() is None
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        assert live.is_dir()  # nothing removes it until the next prepare of out
        assert main(["prepare", str(source), "--out", str(out), "--quiet", "--force"]) == 0
        assert capsys.readouterr().err == f"notice: removed '{live}', {notice}\n"
    finally:
        writer.kill()
        writer.wait()
    assert (foreign / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".prep.tmp-notes",
        "c.jsonl",
        "prep",
    ]
    assert load_prepared(out)[0].tokens.size > 0


def test_a_temporary_removed_before_its_writer_locks_it_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between creating its temporary and locking it, a prepare may find it removed by
    another prepare of the same output (which saw it unlocked): it makes a new one."""
    import fcntl
    import shutil

    from bdh_train.storage import output

    source = write_jsonl(tmp_path / "c.jsonl", CORPUS[:5])
    flock, removed = fcntl.flock, []

    def removed_first(fd: int, operation: int) -> None:
        if not removed:  # the first temporary, gone before its writer holds it
            (first,) = tmp_path.glob(".prep.tmp-*")
            shutil.rmtree(first)
            removed.append(first)
        flock(fd, operation)

    monkeypatch.setattr(output.fcntl, "flock", removed_first)
    prepare_corpus([source], tmp_path / "prep", progress=False)
    assert len(removed) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "prep"]
    assert load_prepared(tmp_path / "prep")[0].tokens.size > 0


def test_training_a_bpe_shows_one_bar_of_ours_and_no_stage_lines_on_a_terminal(tmp_path, capsys):
    """With --train-tokenizer on a terminal, the BPE pass is one tqdm bar ("train BPE") on
    stderr; the tokenizers library's own stage bars (lines of their own, written straight to
    a terminal's descriptor 2) stay off."""
    import os

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    master, terminal = os.openpty()
    saved = os.dup(2)
    os.dup2(terminal, 2)
    try:
        prepare_corpus([corpus], tmp_path / "out", train_bpe_vocab=270, progress=True)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(terminal)
    os.set_blocking(master, False)
    written = b""
    try:
        while chunk := os.read(master, 1 << 16):
            written += chunk
    except (BlockingIOError, OSError):
        pass
    os.close(master)
    assert b"Pre-processing" not in written and b"Compute merges" not in written, written
    err = capsys.readouterr().err
    assert "train BPE: 100%" in err and "prepare: 100%" in err
