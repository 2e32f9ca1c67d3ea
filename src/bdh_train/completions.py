"""Completions of many prompts in one call: `bdh-train generate --prompts-file`.

The prompts come as JSON lines, one object a line with its text under "prompt" (any other
keys, an id say, are copied to the output). `read_prompts` reads and checks the whole file
before anything is generated, so a bad line is refused with its line number and nothing is
printed. `complete` generates them in batches of rows that step together (`BDH.generate_batch`:
each prompt read alone, then one step for all rows; a row that samples a stop token leaves
its batch) and yields each record with its "completion" (the new text, the stop token left
out) and "stop" (the stop text it ended on, or None when it ran to the token limit).
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bdh_train.data.tokenizer import Tokenizer
from bdh_train.errors import DataError
from bdh_train.inference import encode_text
from bdh_train.model import BDH
from bdh_train.model.summary import SummaryEvents

PROMPT_KEY = "prompt"
COMPLETION_KEY = "completion"
STOP_KEY = "stop"
EXAMPLE_LINE = '{"prompt": "text"}'
JSON_KINDS = {
    type(None): "null",
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}
"""The JSON name of each type `json.loads` gives."""


@dataclass(frozen=True)
class PromptRecord:
    """One line of a prompts file: the object read and the prompt's token ids (an empty
    prompt reads as a newline, as `generate` without --prompt does)."""

    fields: dict[str, Any]
    ids: list[int]


def read_prompts(path: str | Path, tokenizer: Tokenizer) -> list[PromptRecord]:
    """Every prompt of a JSON lines file, blank lines skipped; DataError naming the file and
    line for a line that is not UTF-8, not a JSON object (NaN and Infinity are not JSON), has
    no string "prompt", already holds a key the output writes, or whose prompt is not text
    (a lone surrogate) or has no tokens; and for a file without prompts."""
    path = Path(path)
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read the prompts file {path}: {exc.strerror or exc}") from exc
    records = []
    # a byte-order mark (Windows editors write one) opens the file, not a line
    for number, raw in enumerate(content.removeprefix(codecs.BOM_UTF8).splitlines(), start=1):
        where = f"{path}:{number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{where}: not UTF-8 (byte {exc.start + 1} of the line); save the prompts "
                "file as UTF-8"
            ) from exc
        if not text.strip():
            continue
        try:
            fields = json.loads(text, parse_constant=functools.partial(_refuse_constant, where))
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{where}: not JSON ({exc.msg}, column {exc.colno}); each line must be an "
                f"object such as {EXAMPLE_LINE}"
            ) from exc
        if not isinstance(fields, dict):
            raise DataError(
                f"{where}: a JSON {JSON_KINDS[type(fields)]}, not an object; each line must be an "
                f"object such as {EXAMPLE_LINE}"
            )
        if PROMPT_KEY not in fields:
            raise DataError(
                f'{where}: no "{PROMPT_KEY}" key; each line must be an object such as '
                f"{EXAMPLE_LINE}"
            )
        prompt = fields[PROMPT_KEY]
        if not isinstance(prompt, str):
            raise DataError(
                f'{where}: "{PROMPT_KEY}" is a JSON {JSON_KINDS[type(prompt)]}, not a string'
            )
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
        records.append(PromptRecord(fields, ids))
    if not records:
        raise DataError(f"{path}: no prompts; write one JSON object a line, such as {EXAMPLE_LINE}")
    return records


def _refuse_constant(where: str, name: str) -> float:
    """json's hook for NaN, Infinity and -Infinity, which JSON itself does not have (and the
    output could not repeat as JSON)."""
    raise DataError(f"{where}: {name} is not a JSON value; write it as a string or a number")


def complete(
    model: BDH,
    tokenizer: Tokenizer,
    records: Sequence[PromptRecord],
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
    for start in range(0, len(records), batch_size):
        batch = records[start : start + batch_size]
        rows = model.generate_batch(
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
