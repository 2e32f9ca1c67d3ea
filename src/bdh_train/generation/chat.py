"""Chat and streamed text: stop texts (each one token of the run's tokenizer), the token
stream that ends before a stop, text written as it is decoded, and `chat`, turns read from
the input and answered by one `Continuation` (terminal, pipe or JSON lines)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import TextIO

import torch

from bdh_train.data.tokenizer import (
    Tokenizer,
)
from bdh_train.errors import ConfigError
from bdh_train.generation.continuation import Continuation
from bdh_train.shared.loading import encode_text


def stop_token_ids(stops: Sequence[str], tokenizer: Tokenizer) -> dict[int, str]:
    """{token id: text} of each stop text, which must be exactly one token of `tokenizer`
    (ConfigError otherwise)."""
    found: dict[int, str] = {}
    for text in stops:
        ids = encode_text(tokenizer, text, f"--stop {text!r}")
        if len(ids) != 1:
            raise ConfigError(
                f"--stop {text!r} is {len(ids)} tokens in this run's tokenizer; a stop must "
                "be exactly one token"
            )
        found[ids[0]] = text
    return found


def until_stop(tokens: Iterable[int], stops: Collection[int]) -> Iterator[int]:
    """The tokens before the first one in `stops`. The stop itself is not yielded and, since
    the iteration ends on it, a `Continuation.sample` stream does not read it into the state
    (its next step never runs); `tokens` is closed then."""
    iterator = iter(tokens)
    try:
        for token in iterator:
            if token in stops:
                return
            yield token
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def stream_text(tokens: Iterable[int], out: TextIO, tokenizer: Tokenizer) -> None:
    """Write tokens to `out` as UTF-8 text as they come: each token's bytes are decoded on
    top of the ones before, so a character split across tokens prints whole (bytes that are
    not valid UTF-8 as U+FFFD)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in tokens:
        out.write(decoder.decode(tokenizer.decode_bytes([token])))
        out.flush()
    out.write(decoder.decode(b"", final=True))


CHAT_STYLES = ("terminal", "pipe", "jsonl")
"""How `chat` writes a turn: terminal: the reply, a newline and the prompt; pipe: the reply,
a newline and an end line (`reply_end_line`); jsonl: one JSON object a turn (`chat_turn`)."""


def _recorded(tokens: Iterator[int], seen: list[int]) -> Iterator[int]:
    """`tokens`, each appended to `seen` as it passes; closing this closes `tokens`."""
    try:
        for token in tokens:
            seen.append(token)
            yield token
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()


def cut_mid_word(text: str, tokens: int, max_new_tokens: int, stopped: bool) -> bool:
    """Whether a reply ended by the token limit in the middle of a word: no stop ended it,
    it has `max_new_tokens` tokens, and its last character is a letter or a digit."""
    return not stopped and tokens == max_new_tokens > 0 and text[-1:].isalnum()


def reply_end_line(number: int, cut: bool, max_new_tokens: int) -> str:
    """The line that ends reply `number` in a piped chat."""
    if cut:
        return (
            f"--- end of reply {number}: cut mid-word at the limit of {max_new_tokens} tokens ---"
        )
    return f"--- end of reply {number} ---"


def chat_turn(
    number: int, line: str, reply: list[int], stop: int | None, cut: bool, tokenizer: Tokenizer
) -> dict[str, object]:
    """One turn of `chat --jsonl`: its number, the line read (without its newline), the reply's
    text and token count, the stop it ended on (or None) and whether it was cut mid-word."""
    return {
        "turn": number,
        "input": line.removesuffix("\n"),
        "reply": tokenizer.decode(reply),
        "tokens": len(reply),
        "stop": None if stop is None else tokenizer.decode([stop]),
        "cut": cut,
    }


def chat(
    continuation: Continuation,
    tokenizer: Tokenizer,
    lines: Iterable[str],
    out: TextIO,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    prompt: str = "",
    stops: Collection[int] = (),
    style: str = "terminal",
) -> int:
    """A REPL: each line read (newline included) is fed on top of everything before it, then
    up to `max_new_tokens` are sampled (a token of `stops` ends the reply, unwritten and
    unread) and written as `style` says (`CHAT_STYLES`; a terminal's `prompt` after each
    reply). Returns the turns taken."""
    if style not in CHAT_STYLES:
        raise ValueError(f"chat style {style!r} is not one of {CHAT_STYLES}")
    turns = 0
    for number, line in enumerate(lines, 1):
        continuation.feed(encode_text(tokenizer, line, f"line {number} of the chat input"))
        seen: list[int] = []
        sampled = continuation.sample(max_new_tokens, temperature, top_k, generator)
        reply = until_stop(_recorded(sampled, seen), stops)
        if style == "jsonl":
            for _ in reply:
                pass
        else:
            stream_text(reply, out, tokenizer)
            out.write("\n")
        stop = seen[-1] if seen and seen[-1] in stops else None
        shown = seen[:-1] if stop is not None else seen
        cut = cut_mid_word(tokenizer.decode(shown), len(shown), max_new_tokens, stop is not None)
        if style == "jsonl":
            out.write(json.dumps(chat_turn(number, line, shown, stop, cut, tokenizer)) + "\n")
        elif style == "pipe":
            out.write(reply_end_line(number, cut, max_new_tokens) + "\n")
        else:
            out.write(prompt)
        out.flush()
        turns += 1
    return turns
