"""Corpus formats: the same documents from .txt, JSON lines, parquet, gzip and zstd; streamed
UTF-8 checks; long documents cut where tokenization is unchanged; one clear line for a file
that is not text."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from bdh_train.data import corpus_files, formats, load_tokens
from bdh_train.data.corpus_files import SNIFF_BYTES
from bdh_train.data.encode import encode_texts
from bdh_train.data.formats import iter_documents, split_text
from bdh_train.data.tokenizer import ByteTokenizer, piece_cuts, train_bpe
from bdh_train.errors import DataError

DOCS = [
    "The first document.\nIt has two lines.\n",
    "Zweites Dokument: Grüße, 世界 and emoji 🐉.",
    "  leading spaces\n\n\nblank lines\tand tabs  \n",
    "x",
]


def write_txt_dir(root: Path, docs: list[str]) -> Path:
    root.mkdir()
    for i, doc in enumerate(docs):
        (root / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    return root


def jsonl_bytes(docs: list[str], field: str = "text") -> bytes:
    lines = [json.dumps({"id": i, field: d}, ensure_ascii=i % 2 == 0) for i, d in enumerate(docs)]
    return ("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n").encode("utf-8")


def write_all_formats(tmp_path: Path, docs: list[str]) -> dict[str, Path]:
    """The same documents in every format (a .txt directory: one file per document)."""
    out = {"txt-dir": write_txt_dir(tmp_path / "txt", docs)}
    raw = jsonl_bytes(docs)
    out["jsonl"] = tmp_path / "c.jsonl"
    out["jsonl"].write_bytes(raw)
    out["jsonl.gz"] = tmp_path / "c.jsonl.gz"
    out["jsonl.gz"].write_bytes(gzip.compress(raw, mtime=0))
    out["json.zst"] = tmp_path / "c.json.zst"
    out["json.zst"].write_bytes(zstandard.ZstdCompressor().compress(raw))
    out["parquet"] = tmp_path / "c.parquet"
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, out["parquet"], row_group_size=2)
    out["parquet.gz"] = tmp_path / "c.parquet.gz"
    out["parquet.gz"].write_bytes(gzip.compress(out["parquet"].read_bytes(), mtime=0))
    gz_dir = tmp_path / "gz"
    gz_dir.mkdir()
    for i, doc in enumerate(docs):
        (gz_dir / f"doc{i:02d}.txt.gz").write_bytes(gzip.compress(doc.encode(), mtime=0))
    out["txt.gz-dir"] = gz_dir
    return out


def test_every_format_gives_the_same_documents(tmp_path: Path) -> None:
    for name, path in write_all_formats(tmp_path, DOCS).items():
        assert list(iter_documents([path])) == DOCS, name


def test_every_format_gives_the_same_tokens_at_load(tmp_path: Path) -> None:
    """The memory-mapped byte path of a .txt directory (fast) and the document path of every
    other format (the writer `prepare` uses) agree; so do they under a BPE."""
    sources = write_all_formats(tmp_path, DOCS)
    fast = load_tokens(str(sources["txt-dir"]))
    assert isinstance(fast.tokens, np.ndarray) and fast.byte_level
    assert bytes(fast.tokens.astype(np.uint8)) == "\n".join(DOCS).encode()
    bpe = train_bpe(DOCS * 3, 300)
    by_bpe = load_tokens(str(sources["txt-dir"]), 300, tokenizer=bpe)
    for name, path in sources.items():
        data = load_tokens(str(path))
        assert data.tokens.tolist() == fast.tokens.tolist(), name
        assert data.doc_starts.tolist() == fast.doc_starts.tolist(), name
        other = load_tokens(str(path), 300, tokenizer=bpe)
        assert other.tokens.tolist() == by_bpe.tokens.tolist(), name
        assert other.doc_starts.tolist() == by_bpe.doc_starts.tolist(), name
    ids = by_bpe.tokens.tolist()
    assert ids.count(bpe.eot_id) == len(DOCS) and ids[-1] == bpe.eot_id
    assert not by_bpe.byte_level and by_bpe.eot_id == bpe.eot_id


def test_byte_encoding_fast_path_matches_the_tokenizer() -> None:
    texts = [*DOCS, ""]
    fast = encode_texts(ByteTokenizer(), texts)
    assert [a.tolist() for a in fast] == ByteTokenizer().encode_batch(texts)


def test_utf8_is_checked_as_it_streams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus_files, "READ_BYTES", 3)  # multi-byte characters straddle reads
    monkeypatch.setattr(formats, "PIECE_CHARS", 8)
    text = "Grüße\n世界 🐉\nline\nend"
    path = tmp_path / "a.txt"
    path.write_text(text, encoding="utf-8")
    pieces = list(formats.read_pieces(path, "text", formats.CUT_ANYWHERE))
    assert "".join(p.text for p in pieces) == text and len(pieces) > 1
    assert [p.starts_document for p in pieces if p.text] == [True] + [False] * (
        len([p for p in pieces if p.text]) - 1
    )
    assert sum(p.source_bytes for p in pieces) == path.stat().st_size
    bad = tmp_path / "bad.txt"
    bad.write_bytes("Grüße".encode() + b"\xff tail")
    with pytest.raises(DataError, match=r"bad.txt' is not UTF-8 text \(invalid UTF-8 at byte 7\)"):
        list(formats.read_pieces(bad, "text", None))
    for content, offset in ((b"ab\xc3\x28cd", 2), (b"abcd\xe2\x82\x28cd", 4)):
        bad.write_bytes(content)  # the invalid sequence starts in an earlier read
        with pytest.raises(DataError, match=rf"invalid UTF-8 at byte {offset}\)"):
            list(formats.read_pieces(bad, "text", None))
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"abc\x00def")
    with pytest.raises(DataError, match=r"NUL byte at byte 3"):
        list(formats.read_pieces(nul, "text", None))


@pytest.mark.parametrize("piece_chars", [1, 4, 9, 30])
def test_pieces_encode_like_the_whole_document(
    piece_chars: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cutting only after a lone newline between visible characters leaves a byte-level BPE's
    ids unchanged (the slow twin: the whole document encoded at once), for a document given
    as a string and for a text file streamed in small reads."""
    text = (
        "alpha beta\ngamma  \ndelta\n\n\nepsilon\n zeta\neta's\nthe\n(x)\n  y\nz\n"
        "über\n世界\n🐉\n!\nend \n\nnext  \nword \n\nmore\t\nx \n\n"
    ) * 3  # " \n" is a whole-text pre-token, so a cut after "  \n" would change the ids
    bpe = train_bpe([text], 320)
    assert piece_cuts(bpe) == formats.CUT_AT_WHITESPACE
    pieces = split_text(text, formats.CUT_AT_WHITESPACE, piece_chars)
    assert "".join(pieces) == text
    assert len(pieces) > 1
    joined = [i for ids in bpe.encode_batch(pieces) for i in ids]
    assert joined == bpe.encode(text)
    monkeypatch.setattr(formats, "PIECE_CHARS", piece_chars)
    monkeypatch.setattr(corpus_files, "READ_BYTES", 5)
    path = tmp_path / "doc.txt"
    path.write_text(text, encoding="utf-8")
    assert len([p for p in formats.read_pieces(path, "text", "whitespace") if p.text]) > 1
    loaded = load_tokens(str(path), 320, tokenizer=bpe)
    assert loaded.tokens.tolist() == [*bpe.encode(text), bpe.eot_id]


def test_crlf_text_streams_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CRLF line ends are cut between "\r" and "\n" (a byte-level BPE's boundary), so a CRLF
    file streams in several pieces whose ids are the whole document's; a line with no line
    end gets a space cut once it passes MAX_PIECE_CHARS, and one with no space is refused."""
    text = "".join(f"line {i} has words\r\n" for i in range(40)) + "x  \r\n\r\nend\r\n"
    bpe = train_bpe([text], 300)
    monkeypatch.setattr(formats, "PIECE_CHARS", 30)
    monkeypatch.setattr(formats, "MAX_PIECE_CHARS", 60)
    monkeypatch.setattr(corpus_files, "READ_BYTES", 7)
    path = tmp_path / "crlf.txt"
    path.write_bytes(text.encode())
    pieces = [p.text for p in formats.read_pieces(path, "text", formats.CUT_AT_WHITESPACE)]
    assert "".join(pieces) == text and len(pieces) > 10
    assert max(map(len, pieces)) <= 30 + 7 + 20  # a line and a read past the piece size
    assert any(p.endswith("\r") for p in pieces)
    assert [i for ids in bpe.encode_batch(pieces) for i in ids] == bpe.encode(text)
    assert load_tokens(str(path), 300, tokenizer=bpe).tokens.tolist() == [
        *bpe.encode(text),
        bpe.eot_id,
    ]
    long_line = " ".join(f"w{i}" for i in range(60))
    path.write_text(long_line)
    pieces = [p.text for p in formats.read_pieces(path, "text", formats.CUT_AT_WHITESPACE)]
    assert "".join(pieces) == long_line and 1 < len(pieces) < 10
    assert [i for ids in bpe.encode_batch(pieces) for i in ids] == bpe.encode(long_line)
    path.write_text("x" * 200)
    with pytest.raises(DataError, match=r"crlf.txt' has \d+ characters without a newline"):
        list(formats.read_pieces(path, "text", formats.CUT_AT_WHITESPACE))
    assert "".join(p.text for p in formats.read_pieces(path, "text", "anywhere")) == "x" * 200


def test_other_tokenizers_get_whole_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer whose ids depend on where a piece starts (Metaspace adds a prefix "▁" to
    each piece) is given whole documents: its ids are the whole document's."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, trainers

    from bdh_train.data.tokenizer import HFTokenizer

    text = "".join(f"line {i} has words\n" for i in range(40))
    hf = HF(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.train_from_iterator(
        [text],
        trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"], show_progress=False),
    )
    metaspace = HFTokenizer(hf)
    assert piece_cuts(metaspace) is None
    monkeypatch.setattr(formats, "PIECE_CHARS", 30)
    monkeypatch.setattr(corpus_files, "READ_BYTES", 7)
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"text": text}) + "\n")
    path = tmp_path / "doc.txt"
    path.write_text(text)
    cut = split_text(text, formats.CUT_AT_WHITESPACE, 30)
    assert [i for ids in metaspace.encode_batch(cut) for i in ids] != metaspace.encode(text)
    for source in (path, jsonl):
        loaded = load_tokens(str(source), metaspace.vocab_size, tokenizer=metaspace)
        assert loaded.tokens.tolist() == [*metaspace.encode(text), metaspace.eot_id]


def test_directory_is_recursive_sorted_and_skips_other_files(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.txt").write_text("b/x")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "c.jsonl").write_text('{"text": "c"}\n')
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / "notes.md").write_text("markdown")  # text by its bytes, whatever its name
    (tmp_path / "b" / "x.pyc").write_bytes(b"\xcb\r\r\n\x00\x00")  # binary: skipped
    (tmp_path / "b" / "y.png").write_bytes(b"\x89PNG\r\n")  # not UTF-8: skipped
    (tmp_path / "t.bin").write_bytes(b"ab")  # a token file: skipped
    (tmp_path / "old.md.gz").write_bytes(b"")  # compressed, of no corpus format: skipped
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "meta.json").write_text('{"format": "bdh-train prepared corpus"}')
    (tmp_path / "prepared" / "more.txt").write_text("inside a prepared corpus")
    (tmp_path / "site").mkdir()  # some other tool's meta.json: an ordinary folder
    (tmp_path / "site" / "meta.json").write_text('{"text": "site/meta", "title": "other"}')
    (tmp_path / "site" / "page.txt").write_text("site/page")
    expected = ["a", "b/x", "c", "markdown", "site/meta", "site/page"]
    assert list(iter_documents([tmp_path])) == expected


def test_a_txt_file_in_a_directory_that_is_not_utf8_is_refused_not_skipped(tmp_path: Path):
    """A .txt is corpus by its name: Latin-1 or UTF-16 text in one is one DataError naming
    it, as for the file given alone; the same bytes under a name of no format are skipped as
    not text, also where the byte that is not UTF-8 ends the file."""
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "notes.dat").write_bytes("café".encode("latin-1"))
    (tmp_path / "more.dat").write_bytes("café au lait".encode("latin-1"))
    (tmp_path / "edge.dat").write_bytes(b"a" * (SNIFF_BYTES - 1) + b"\xe9")  # the sniff's size
    assert list(iter_documents([tmp_path])) == ["a"]
    for name, data in [("b.txt", "café".encode("latin-1")), ("c.txt", "hi".encode("utf-16"))]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=rf"{name}' is not UTF-8 text"):
            list(iter_documents([tmp_path]))
        (tmp_path / name).unlink()


def test_a_folder_reached_again_through_links_is_read_once(tmp_path: Path) -> None:
    """A link to the folder itself (a loop; it read the file ~40 times) and a second link to
    a folder: each file is one document."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a")
    (corpus / "self").symlink_to(".")
    assert list(iter_documents([corpus])) == ["a"]
    (corpus / "b").mkdir()
    (corpus / "b" / "x.txt").write_text("b/x")
    (corpus / "c").symlink_to("b")
    assert list(iter_documents([corpus])) == ["a", "b/x"]


def test_binary_file_is_one_clear_line(tmp_path: Path) -> None:
    blob = tmp_path / "weights.dat"
    blob.write_bytes(bytes(range(256)) * 4)
    for call in (lambda: load_tokens(str(blob)), lambda: list(iter_documents([blob]))):
        with pytest.raises(DataError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message
        assert re.search(r"weights.dat' is not UTF-8 text .*bdh-train prepare", message)
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(bytes(range(256)))
    with pytest.raises(
        DataError,
        match=r"tokens.bin' is not UTF-8 .*holds token ids, which "
        r"`bdh-train prepare` does not read: train on it with data.source",
    ):
        list(iter_documents([tokens]))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"text": "ok"}\nnot json\n', r"line 2 of .*c.jsonl' is not JSON"),
        (
            b'{"body": "x"}\n',
            r"line 1 .* no field 'text' \(it has \['body'\]\).*--text-field / data.text_field",
        ),
        (b'{"text": 3}\n', r"field 'text' is a int, not a string"),
        (b'{"text": "\xff"}\n', r"c.jsonl' is not UTF-8 text"),
        (
            b'{"text": "ok"}\n{"text": "a\\ud800b"}\n',
            r"c.jsonl' is not UTF-8 text \(a lone surrogate in field 'text' on line 2\)",
        ),
        (
            b'{"text": "a\xed\xa0\x80b"}\n',  # json.loads reads raw surrogate bytes too
            r"c.jsonl' is not UTF-8 text \(a lone surrogate in field 'text' on line 1\)",
        ),
        (
            b'{"text": "a", "n": ' + b"9" * 5000 + b"}\n",
            r"line 1 of .*c.jsonl' is not JSON \(Exceeds the limit \(4300 digits\)",
        ),
        (
            b"[" * 100_000 + b"]" * 100_000 + b"\n",
            r"line 1 of .*c.jsonl' is not JSON \(maximum recursion depth exceeded",
        ),
    ],
)
def test_bad_json_lines(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=expected):
        list(iter_documents([path]))


def test_other_text_field_and_parquet_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(jsonl_bytes(DOCS, field="body"))
    assert list(iter_documents([path], text_field="body")) == DOCS
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"n": [1, 2]}), table)
    with pytest.raises(DataError, match=r"no column 'text' \(it has \['n'\]\); .*data.text_field"):
        list(iter_documents([table]))
    pq.write_table(pa.table({"text": [1, 2]}), table)
    with pytest.raises(DataError, match=r"column 'text' is int64, not a string column"):
        list(iter_documents([table]))
    offsets = pa.py_buffer(np.array([0, 6], dtype=np.int32).tobytes())
    not_utf8 = pa.Array.from_buffers(pa.string(), 1, [None, offsets, pa.py_buffer(b"ab\xff\xfecd")])
    pq.write_table(pa.table({"text": not_utf8}), table)
    with pytest.raises(
        DataError,
        match=r"t.parquet' is not UTF-8 text \(invalid UTF-8 in column "
        r"'text': invalid start byte\)",
    ):
        list(iter_documents([table]))
    pq.write_table(pa.table({"text": ["fine", "a\x00b"]}), table)
    with pytest.raises(
        DataError,
        match=r"t.parquet' is not UTF-8 text \(NUL character in column "
        r"'text'\)",
    ):
        list(iter_documents([table]))
    broken = tmp_path / "b.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"cannot read .*b.jsonl.gz'.*not gz compressed"):
        list(iter_documents([broken]))
    body = bytearray(gzip.compress(bytes(range(97, 123)) * 8000, mtime=0))
    body[20:120] = bytes(b ^ 255 for b in body[20:120])  # a deflate stream zlib refuses
    broken.write_bytes(bytes(body))
    with pytest.raises(DataError, match=r"cannot read .*b.jsonl.gz': Error -3 while decomp"):
        list(iter_documents([broken]))


def test_saved_hugging_face_dataset(tmp_path: Path) -> None:
    """Read with `datasets` when it is installed; without it, one line saying to install it."""
    saved = tmp_path / "ds"
    try:
        import datasets
    except ImportError:
        saved.mkdir()
        (saved / "dataset_info.json").write_text("{}")
        (saved / "state.json").write_text("{}")
        with pytest.raises(DataError, match=r"saved Hugging Face dataset: .*pip install datasets"):
            list(iter_documents([saved]))
        return
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(saved))
    assert list(iter_documents([saved])) == DOCS


class BytesWithEot:
    """A non-byte tokenizer as far as loading is concerned: UTF-8 bytes plus an id 256 that
    ends documents (cheap, so a whole builtin corpus encodes in a blink)."""

    kind = "test"
    vocab_size = 257
    eot_id = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def token_byte_lengths(self) -> np.ndarray:
        return np.array([1] * 256 + [0])


def test_builtin_corpus_under_a_tokenizer_is_one_document() -> None:
    from bdh_train.data import builtin_corpus

    data = load_tokens("builtin:pydoc", 257, tokenizer=BytesWithEot())  # type: ignore[arg-type]
    assert data.doc_starts.tolist() == [0] and data.tokens[-1] == 256 and not data.byte_level
    assert bytes(data.tokens[:-1].astype(np.uint8)) == builtin_corpus("pydoc").encode()


def test_damaged_and_truncated_zstd_are_one_line(tmp_path: Path) -> None:
    """Garbage, and a frame cut short (which zstandard's stream_reader ends quietly), are one
    DataError naming the file; concatenated frames read whole."""
    raw = jsonl_bytes(DOCS * 40)
    whole = zstandard.ZstdCompressor().compress(raw)
    frames = tmp_path / "frames.jsonl.zst"
    frames.write_bytes(whole + zstandard.ZstdCompressor().compress(raw))
    assert list(iter_documents([frames])) == DOCS * 80
    cases = {
        "garbage.txt.zst": b"this is not zstd data at all" * 10,
        "cut.txt.zst": zstandard.ZstdCompressor().compress(("Grüße " * 5000).encode())[:-9],
        "cut.jsonl.zst": whole[: len(whole) // 2],
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(DataError) as info:
            list(iter_documents([path]))
        message = str(info.value)
        assert "\n" not in message and name in message, message
        assert re.search(r"damaged|truncated", message), message
