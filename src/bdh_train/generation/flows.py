"""What `bdh-train generate` and `bdh-train chat` do with a loaded run, as plain functions of
the values the command line gave: `complete_prompts_file` (--prompts-file: batches of rows
that step together), `continue_prompt` (--prompt: one stream, or a `Continuation` when a state
is loaded or saved) and `chat_session` (lines read, each continuing one carried state).

Every flow draws its tokens with one seeded generator on the model's device and the model's
one sampling loop (`model/sampling.sample_tokens`), so a seed gives the same text however
the command is built.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TextIO

import torch

from bdh_train.config import RunConfig
from bdh_train.data.tokenizer import Tokenizer
from bdh_train.generation.chat import chat, stop_token_ids, stream_text, until_stop
from bdh_train.generation.completions import complete, read_prompts
from bdh_train.generation.continuation import Continuation
from bdh_train.model import BDH, sampling
from bdh_train.shared.loading import encode_text, summary_events


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: up to `max_new_tokens` (per turn in chat) at `temperature` (0:
    greedy) from the `top_k` most likely (None: all), seeded by `seed`; a token of `stops`
    (texts, each one token of the run's tokenizer) ends a completion or a reply."""

    max_new_tokens: int
    temperature: float
    top_k: int | None
    seed: int
    stops: tuple[str, ...] = ()


@dataclass(frozen=True)
class StateFiles:
    """The state a flow starts from (`load`, a file `--save-state` wrote) and where it saves
    the state it ends with (`save`, replacing an existing file only with `force`)."""

    load: str | None = None
    save: str | None = None
    force: bool = False


def _generator(model: BDH, seed: int) -> torch.Generator:
    return torch.Generator(device=model.embed.weight.device).manual_seed(seed)


def complete_prompts_file(
    model: BDH,
    tokenizer: Tokenizer,
    config: RunConfig,
    draw: Sampling,
    path: str,
    batch_size: int,
    out: TextIO,
) -> None:
    """Write each prompt of the prompts file `path` with its completion to `out`, one JSON
    line each (ASCII: any other character escaped, whatever the terminal's encoding)."""
    events = summary_events(model, config)
    generator = _generator(model, draw.seed)
    stops = stop_token_ids(draw.stops, tokenizer)
    records = read_prompts(path, tokenizer)
    for done in complete(
        model,
        tokenizer,
        records,
        draw.max_new_tokens,
        batch_size,
        temperature=draw.temperature,
        top_k=draw.top_k,
        generator=generator,
        stops=stops,
        summary_events=events,
    ):
        out.write(json.dumps(done) + "\n")
        out.flush()


def continue_prompt(
    model: BDH,
    tokenizer: Tokenizer,
    config: RunConfig,
    draw: Sampling,
    prompt: str | None,
    out: TextIO,
    states: StateFiles = StateFiles(),
    report: TextIO | None = None,
) -> None:
    """Write `prompt` and its continuation to `out` as the tokens come, then end the line.
    Without a state file, one `sampling.stream_generate` call (an absent or empty prompt reads
    a newline); with one, the prompt is read into a `Continuation` after `states.load`'s state
    (an absent prompt then reads nothing more) and before `states.save`, which is said on
    `report`."""
    events = summary_events(model, config)
    generator = _generator(model, draw.seed)
    stops = stop_token_ids(draw.stops, tokenizer)
    if states.load is None and states.save is None:
        text = "\n" if prompt is None else prompt
        ids = torch.tensor(
            encode_text(tokenizer, text or "\n", "--prompt"),
            dtype=torch.long,
            device=model.embed.weight.device,
        )
        out.write(text)
        out.flush()
        stream = sampling.stream_generate(
            model,
            ids,
            draw.max_new_tokens,
            draw.temperature,
            draw.top_k,
            generator,
            summary_events=events,
        )
        tokens: Iterable[int] = (int(token) for token in stream)
    else:
        cont = Continuation(model, events)
        text = prompt if prompt is not None else ("" if states.load else "\n")
        if states.load is None:  # an empty prompt with nothing read before reads a newline
            text = text or "\n"
        read = encode_text(tokenizer, text, "--prompt")
        if states.load is not None:
            cont.load(states.load)
        cont.feed(read)
        if states.save is not None:
            _save_state(cont, states.save, states.force, report)
        out.write(text)
        tokens = cont.sample(draw.max_new_tokens, draw.temperature, draw.top_k, generator)
    _stream_line(until_stop(tokens, stops), out, tokenizer)


def chat_session(
    model: BDH,
    tokenizer: Tokenizer,
    config: RunConfig,
    draw: Sampling,
    lines: TextIO,
    out: TextIO,
    states: StateFiles = StateFiles(),
    jsonl: bool = False,
    report: TextIO | None = None,
) -> None:
    """Chat over `lines` (a terminal's get a "> " prompt, unless `jsonl`): each line read
    continues one carried state, from `states.load`'s when given, saved to `states.save` when
    the lines end (said on `report`)."""
    stops = stop_token_ids(draw.stops, tokenizer)
    cont = Continuation(model, summary_events(model, config))
    if states.load is not None:
        cont.load(states.load)
    generator = _generator(model, draw.seed)
    terminal = lines.isatty() and not jsonl
    prompt = "> " if terminal else ""
    out.write(prompt)
    out.flush()
    chat(
        cont,
        tokenizer,
        lines,
        out,
        draw.max_new_tokens,
        draw.temperature,
        draw.top_k,
        generator,
        prompt=prompt,
        stops=stops,
        style="jsonl" if jsonl else "terminal" if terminal else "pipe",
    )
    if states.save is not None:
        _save_state(cont, states.save, states.force, report)


def _stream_line(tokens: Iterator[int], out: TextIO, tokenizer: Tokenizer) -> None:
    """Write `tokens` as text as they come, then end the line, also when Ctrl-C stops the
    stream (the "interrupted" on stderr then starts a line of its own)."""
    try:
        stream_text(tokens, out, tokenizer)
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        raise
    out.write("\n")


def _save_state(cont: Continuation, path: str, force: bool, report: TextIO | None) -> None:
    """Save a Continuation's state to `path`, saying so on `report`."""
    saved = cont.save(path, force)
    if report is not None:
        report.write(f"saved the state after {cont.tokens_read} tokens to {saved}\n")
