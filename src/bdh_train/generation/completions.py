"""Completions of many prompts in one call: `bdh-train generate --prompts-file`.

The prompts come as JSON lines, one object a line with its text under "prompt" (any other
keys, an id say, are copied to the output). `read_prompts` reads and checks the whole file
before anything is generated, so a bad line is refused with its line number and nothing is
printed; generation reads it again, so memory holds a line and a batch at a time, not the
file. `complete` generates them in batches of rows that step together
(`sampling.generate_batch`: each prompt read alone, then one step for all rows; a row that
samples a stop token leaves its batch) and yields each record with its "completion" (the new
text, the stop token left out) and "stop" (the stop text it ended on, or None when it ran to
the token limit).
"""

from __future__ import annotations

import codecs
import functools
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bdh_train.data.tokenizer import Tokenizer
from bdh_train.errors import DataError
from bdh_train.model import BDH, sampling
from bdh_train.model.summary import SummaryEvents
from bdh_train.shared.loading import encode_text
from bdh_train.utils import json_kind, open_regular, read_lines

PROMPT_KEY = "prompt"
COMPLETION_KEY = "completion"
STOP_KEY = "stop"
EXAMPLE_LINE = '{"prompt": "text"}'
PROMPT_LINE_MAX_BYTES = 1 << 24
"""The longest line of a prompts file read (16 MiB): a prompt of millions of characters
fits, a file that is no JSON lines (one line of gigabytes) is refused before it fills
memory."""


@dataclass(frozen=True)
class PromptRecord:
    """One line of a prompts file: the object read and the prompt's token ids (an empty
    prompt reads as a newline, as `generate` without --prompt does)."""

    fields: dict[str, Any]
    ids: list[int]


class Prompts:
    """The prompts of a prompts file, every line checked (`read_prompts`). Iterating reads
    the file again, line by line, giving a `PromptRecord` a prompt: memory holds one line at
    a time, whatever the file's size. A file changed since the check is refused when the
    iteration starts."""

    def __init__(self, path: Path, tokenizer: Tokenizer) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self._identity: tuple[int, ...] | None = None
        self._count = sum(1 for _ in self._read())
        if not self._count:
            raise DataError(
                f"{path}: no prompts; write one JSON object a line, such as {EXAMPLE_LINE}"
            )

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[PromptRecord]:
        return self._read()

    def _read(self) -> Iterator[PromptRecord]:
        path = self.path
        try:
            handle = open_regular(
                path,
                f"the prompts file {path}",
                DataError,
                "write the prompts into a file and give its path (generate reads it twice)",
            )
        except OSError as exc:
            raise DataError(f"cannot read the prompts file {path}: {exc.strerror or exc}") from exc
        with handle:
            st = os.fstat(handle.fileno())
            identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if self._identity is None:
                self._identity = identity
            elif identity != self._identity:
                raise DataError(
                    f"the prompts file {path} changed after it was checked; run generate again"
                )
            for number, raw in read_lines(handle, PROMPT_LINE_MAX_BYTES, str(path), DataError):
                # a byte-order mark (Windows editors write one) opens the file, not a line
                line = raw.removeprefix(codecs.BOM_UTF8) if number == 1 else raw
                record = _prompt_record(f"{path}:{number}", line, self.tokenizer)
                if record is not None:
                    yield record


def read_prompts(path: str | Path, tokenizer: Tokenizer) -> Prompts:
    """The prompts of a JSON lines file (a regular file, lines of at most
    PROMPT_LINE_MAX_BYTES), every line checked before this returns: DataError naming the file
    and line for a line that is not UTF-8, not a JSON object (NaN and Infinity are not JSON),
    has no string "prompt", already holds a key the output writes, or whose prompt is not text
    (a lone surrogate) or has no tokens; and for a file without prompts. Blank lines are
    skipped."""
    return Prompts(Path(path), tokenizer)


def _prompt_record(where: str, raw: bytes, tokenizer: Tokenizer) -> PromptRecord | None:
    """The record of one line of a prompts file (`where`: FILE:LINE), None for a blank one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where}: not UTF-8 (byte {exc.start + 1} of the line); save the prompts file as UTF-8"
        ) from exc
    if not text.strip():
        return None
    try:
        fields = json.loads(text, parse_constant=functools.partial(_refuse_constant, where))
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{where}: not JSON ({exc.msg}, column {exc.colno}); each line must be an "
            f"object such as {EXAMPLE_LINE}"
        ) from exc
    if not isinstance(fields, dict):
        raise DataError(
            f"{where}: a JSON {json_kind(fields)}, not an object; each line must be an "
            f"object such as {EXAMPLE_LINE}"
        )
    if PROMPT_KEY not in fields:
        raise DataError(
            f'{where}: no "{PROMPT_KEY}" key; each line must be an object such as {EXAMPLE_LINE}'
        )
    prompt = fields[PROMPT_KEY]
    if not isinstance(prompt, str):
        raise DataError(f'{where}: "{PROMPT_KEY}" is a JSON {json_kind(prompt)}, not a string')
    taken = [key for key in (COMPLETION_KEY, STOP_KEY) if key in fields]
    if taken:
        raise DataError(
            f'{where}: the key "{taken[0]}" is one generate writes into its output; '
            "rename it in the prompts file"
        )
    ids = encode_text(tokenizer, prompt or "\n", f"{where}: the prompt")
    if not ids:
        raise DataError(
            f"{where}: the prompt is 0 tokens in this run's tokenizer (none of its "
            "characters has a token); write it with characters the tokenizer knows"
        )
    return PromptRecord(fields, ids)


def _refuse_constant(where: str, name: str) -> float:
    """json's hook for NaN, Infinity and -Infinity, which JSON itself does not have (and the
    output could not repeat as JSON)."""
    raise DataError(f"{where}: {name} is not a JSON value; write it as a string or a number")


def complete(
    model: BDH,
    tokenizer: Tokenizer,
    records: Iterable[PromptRecord],
    max_new_tokens: int,
    batch_size: int,
    *,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    stops: dict[int, str],
    summary_events: SummaryEvents | None,
) -> Iterator[dict[str, Any]]:
    """Each record's fields with its "completion" and "stop", in the records' order,
    generated `batch_size` rows at a time. Greedy completions (temperature 0) are each
    prompt's alone; sampled rows share `generator`, so their draws depend on the batch."""
    pending = iter(records)
    while batch := list(itertools.islice(pending, batch_size)):
        rows = sampling.generate_batch(
            model,
            [record.ids for record in batch],
            max_new_tokens,
            temperature,
            top_k,
            generator,
            stop_tokens=list(stops),
            summary_events=summary_events,
        )
        for record, row in zip(batch, rows, strict=True):
            new = row[len(record.ids) :].tolist()
            stop = stops.get(new[-1]) if new else None
            if stop is not None:
                new.pop()
            yield {**record.fields, COMPLETION_KEY: tokenizer.decode(new), STOP_KEY: stop}
