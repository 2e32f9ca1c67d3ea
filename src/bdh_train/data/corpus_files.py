"""Which files are a text corpus and how they are opened: the file side of reading corpora
(`formats` reads the documents in them).

A file is named by its format suffix under an optional compression suffix (`.gz`, `.zst`,
decompressed on the fly: `open_binary`). A directory's corpus files (`list_files`,
`is_corpus_file`, the one rule for a file found in a directory) are its .txt, JSON lines
and parquet files, the compressed files of a `DIRECTORY_SUFFIXES` format and any other file
whose first `SNIFF_BYTES` are UTF-8 without NUL bytes, recursively in sorted order of their
relative paths (hidden names skipped); a subdirectory that is a saved Hugging Face dataset is
one entry, and one written by `bdh-train prepare` (`layout.is_prepared`: tokens, not text) is
skipped. Text is checked to be UTF-8 as it streams (`iter_utf8`); a file that is not is
refused with one DataError naming it (`binary_file_error`).
"""

from __future__ import annotations

import codecs
import gzip
import io
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from bdh_train.data.layout import is_prepared
from bdh_train.errors import DataError
from bdh_train.utils import special_file_kind

JSON_LINES_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt",)
COMPRESSED_SUFFIXES = (".gz", ".zst")
DIRECTORY_SUFFIXES = TEXT_SUFFIXES + JSON_LINES_SUFFIXES + PARQUET_SUFFIXES
"""The formats a directory's files are corpus by, plain or compressed (other compressed files
in a directory are ignored)."""
SNIFF_BYTES = 1 << 13
"""How much of a file found in a directory `is_corpus_file` reads to tell text from binary."""
HF_DATASET_MARKERS = (("dataset_info.json", "state.json"), ("dataset_dict.json",))
"""Files that make a directory a Hugging Face `save_to_disk` dataset (a Dataset; a
DatasetDict)."""
READ_BYTES = 1 << 20
"""Bytes read (and UTF-8 checked) per step from a text file."""
ZSTD_FEED_BYTES = 1 << 13
"""Compressed bytes given to the zstd decompressor per step."""
FORMATS_HINT = (
    "give UTF-8 text (.txt), JSON lines (.jsonl/.json), .parquet, any of these as .gz or "
    ".zst, or a saved Hugging Face dataset directory"
)


def binary_file_error(path: Path | str, why: str) -> DataError:
    """The one message for a file that is neither UTF-8 text nor a readable format."""
    if Path(path).suffix == ".bin":
        return DataError(
            f"'{path}' is not UTF-8 text ({why}): a .bin file holds token ids, which "
            f"`bdh-train prepare` does not read: train on it with data.source = '{path}'"
        )
    return DataError(
        f"'{path}' is not UTF-8 text ({why}): convert it to UTF-8 text, or store the corpus "
        f"as .jsonl/.json lines or .parquet (also .gz/.zst) and run `bdh-train prepare` on it; "
        f"a token file needs the .bin suffix"
    )


# ------------------------------------------------------------------------- names and files
def compression_of(path: Path) -> str | None:
    """ "gz", "zst" or None, by the file name's last suffix."""
    suffix = path.suffix.lower()
    return suffix[1:] if suffix in COMPRESSED_SUFFIXES else None


def format_suffix(path: Path) -> str:
    """The format suffix of a file name, under its compression suffix (`a.jsonl.gz` ->
    `.jsonl`)."""
    name = path.name.lower()
    if compression_of(path):
        name = name[: name.rfind(".")]
    return Path(name).suffix


def is_corpus_file(path: Path) -> bool:
    """Whether a file found in a data directory is part of the corpus: .txt, JSON lines or
    parquet by its name (a .txt that is not UTF-8 is then refused as it is read, as one given
    alone is, not skipped), a compressed file of a
    `DIRECTORY_SUFFIXES` format, or (any other name but a .bin token file) text: its first
    `SNIFF_BYTES` are UTF-8 without NUL bytes, the check every text file passes as it is read
    (`iter_utf8`)."""
    suffix = format_suffix(path)
    if compression_of(path):
        return suffix in DIRECTORY_SUFFIXES
    if suffix in DIRECTORY_SUFFIXES:
        return True
    if suffix == ".bin":
        return False
    try:
        with open(path, "rb") as handle:
            head = handle.read(SNIFF_BYTES + 1)
    except OSError as exc:
        raise DataError(f"cannot read data file '{path}': {exc.strerror or exc}") from exc
    try:
        # a cut multi-byte character may end the sniff, not a file read to its end
        final = len(head) <= SNIFF_BYTES
        text = codecs.getincrementaldecoder("utf-8")().decode(head[:SNIFF_BYTES], final=final)
    except UnicodeDecodeError:
        return False
    return "\x00" not in text


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any(
        all((path / name).is_file() for name in marker) for marker in HF_DATASET_MARKERS
    )


def list_files(directory: Path) -> list[Path]:
    """The corpus files (`is_corpus_file`) and saved Hugging Face datasets under `directory`:
    recursive, sorted by relative path, hidden names and prepared corpus directories skipped;
    a folder reached twice through links is walked once."""
    found: list[Path] = []
    visited: set[tuple[int, int]] = set()  # (device, inode) of every folder walked

    def walk(folder: Path) -> None:
        try:
            status = folder.stat()
            if (status.st_dev, status.st_ino) in visited:
                return  # a link back to a folder already walked: its files are found once
            visited.add((status.st_dev, status.st_ino))
            entries = sorted(folder.iterdir(), key=lambda p: p.name)
        except OSError as exc:
            raise DataError(
                f"cannot list data directory '{folder}': {exc.strerror or exc}"
            ) from exc
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                if is_prepared(entry):
                    continue  # a `bdh-train prepare` output: tokens, not text
                if is_hf_dataset(entry):
                    found.append(entry)
                else:
                    walk(entry)
            elif entry.is_file() and is_corpus_file(entry):
                found.append(entry)

    walk(directory)
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


def corpus_files(directory: Path) -> list[Path]:
    """`list_files(directory)`, or DataError when it finds none."""
    found = list_files(directory)
    if not found:
        raise DataError(
            f"data directory '{directory}' contains no corpus files (UTF-8 text files of any "
            f"name, .jsonl, .json, .parquet, .gz/.zst of them, or saved Hugging Face datasets; "
            f"binary and hidden files are skipped); put the corpus files in it or name a "
            f"single file"
        )
    return found


def expand_sources(sources: list[str | os.PathLike[str]]) -> list[Path]:
    """Every file (or saved dataset) the text sources name, in order; DataError for a missing
    path, a prepared corpus (tokens, not text) or a directory without corpus files."""
    files: list[Path] = []
    for source in sources:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"source '{source}' does not exist; {FORMATS_HINT}")
        kind = special_file_kind(path)
        if kind is not None:  # read, a FIFO waits for a writer and a device never ends
            raise DataError(f"source '{source}' is {kind}, not a regular file; {FORMATS_HINT}")
        if is_prepared(path):
            raise DataError(
                f"source '{source}' is a corpus `bdh-train prepare` wrote (tokens, not text): "
                f"train on it with data.source = '{source}', or give the text it came from"
            )
        if path.is_dir() and not is_hf_dataset(path):
            files.extend(corpus_files(path))
        else:
            files.append(path)
    return files


def source_bytes(files: list[Path]) -> int | None:
    """The bytes progress is counted against (the files' sizes), or None when unknown (a
    saved dataset)."""
    total = 0
    for path in files:
        if path.is_dir():
            return None
        total += path.stat().st_size
    return total


# ------------------------------------------------------------------------------ streams
class _CountingReader(io.RawIOBase):
    """A raw file that counts the bytes read from it (the compressed bytes, under a
    decompressor), so progress over compressed files follows their sizes."""

    def __init__(self, raw: io.BufferedReader) -> None:
        self._raw = raw
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        n = self._raw.readinto(buffer)
        self.consumed += n or 0
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


class ZstdTruncatedError(EOFError):
    """A zstd stream that ends inside a frame."""


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of a zstd file of one or more frames. The library's
    `stream_reader` ends quietly at a frame cut short; this raises `ZstdTruncatedError`.
    Compressed input is fed `ZSTD_FEED_BYTES` at a time, which bounds the output held at
    once (zstd expands a byte to at most about 32 KiB)."""

    def __init__(self, raw: io.RawIOBase) -> None:
        import zstandard

        self._raw = raw
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._decompressor = self._new()
        self._in_frame = False  # bytes of an unfinished frame were fed
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            data = self._raw.read(ZSTD_FEED_BYTES)
            if not data:
                if self._in_frame:
                    raise ZstdTruncatedError("the last zstd frame is incomplete (truncated file)")
                return 0
            while data:
                self._in_frame = True
                out = self._decompressor.decompress(data)
                if out:
                    self._pending = memoryview(bytes(self._pending) + out)
                if not self._decompressor.eof:
                    break
                data = self._decompressor.unused_data  # the next frame starts here
                self._decompressor, self._in_frame = self._new(), False
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _zstd_error() -> type[Exception]:
    import zstandard

    return zstandard.ZstdError


@contextmanager
def open_binary(path: Path) -> Iterator[tuple[BinaryIO, _CountingReader]]:
    """(the decompressed byte stream, the counter of raw bytes read) of a file."""
    try:
        raw = _CountingReader(open(path, "rb"))  # noqa: SIM115 - closed below
    except OSError as exc:
        raise DataError(f"cannot read data file '{path}': {exc.strerror or exc}") from exc
    kind = compression_of(path)
    try:
        if kind == "gz":
            stream: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[assignment]
        elif kind == "zst":
            stream = io.BufferedReader(_ZstdReader(raw), READ_BYTES)
        else:
            stream = io.BufferedReader(raw, READ_BYTES)
        with stream:
            yield stream, raw
    except (OSError, EOFError, zlib.error) as exc:  # zlib.error: a damaged gzip body
        raise DataError(
            f"cannot read '{path}': {exc}; the file is damaged or not {kind or 'readable'} "
            f"compressed data"
        ) from exc
    except _zstd_error() as exc:
        raise DataError(
            f"cannot decompress '{path}': {exc}; the file is damaged or not zstd data"
        ) from exc
    finally:
        raw.close()


def iter_utf8(path: Path) -> Iterator[tuple[str, int]]:
    """The text of a (possibly compressed) file in chunks with the raw bytes each consumed,
    checked to be UTF-8 without NUL bytes as it streams."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open_binary(path) as (stream, counter):
        seen = 0
        while True:
            chunk = stream.read(READ_BYTES)
            final = not chunk
            try:
                text = decoder.decode(chunk, final=final)
            except UnicodeDecodeError as exc:
                where = offset + exc.start - len(decoder.getstate()[0])
                raise binary_file_error(path, f"invalid UTF-8 at byte {max(where, 0)}") from None
            if "\x00" in text:
                where = offset + len(text[: text.index("\x00")].encode("utf-8"))
                raise binary_file_error(path, f"NUL byte at byte {where}")
            offset += len(chunk)
            yield text, counter.consumed - seen
            seen = counter.consumed
            if final:
                return


def check_utf8(path: Path) -> None:
    """Raise the binary-file DataError unless the whole file is UTF-8 text (streamed)."""
    for _ in iter_utf8(path):
        pass


@contextmanager
def contextlib_decompressed(path: Path) -> Iterator[Path]:
    """`path` itself, or for a compressed file a temporary decompressed copy (parquet needs
    random access)."""
    if compression_of(path) is None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="bdh-prepare-") as tmp:
        local = Path(tmp) / path.stem
        with open_binary(path) as (stream, _), open(local, "wb") as out:
            shutil.copyfileobj(stream, out, READ_BYTES)
        yield local
