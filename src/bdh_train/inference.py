"""Using a finished run: `load_run` (a run directory, checkpoint or ternary export -> model,
tokenizer, config), a `Continuation` that carries the model's fixed-size state between calls
(what `bdh-train chat` and `generate --save-state/--load-state` are built on), and the state
file that saves one.

A BDH's whole past is its recurrent state: a few tensors per layer whose size does not grow
with the text read. A continuation fed A and then B is the model fed A + B, so a chat turn or
a cached prompt costs only its own tokens.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes

from bdh_train.config import RunConfig, load_config
from bdh_train.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from bdh_train.distributed.env import resolve_device
from bdh_train.errors import BDHTrainError, CheckpointError, ConfigError, DataError
from bdh_train.export import export_tokenizer_json, export_training_json, load_ternary
from bdh_train.model import BDH, BDHConfig, ModelState, sample_next_token
from bdh_train.model.bdh import shape_mismatch, state_shapes
from bdh_train.model.decoders import FastDecoder, GenericDecoder, make_decoder
from bdh_train.model.generate import check_finite_logits, check_finite_weights, read_tokens
from bdh_train.model.summary import SummaryEvents
from bdh_train.storage.output import write_file
from bdh_train.train import checkpoint as ckpt
from bdh_train.train.evaluate import bits_per_byte
from bdh_train.train.run_dir import config_path, run_of_checkpoint
from bdh_train.utils import first_line, read_regular_file

STATE_FORMAT = "bdh-state/1"


def inference_device(name: str | torch.device) -> torch.device:
    """'auto' (CUDA when available), 'cpu', 'cuda' or a torch.device."""
    if isinstance(name, torch.device):
        return name
    try:
        return resolve_device(name)
    except BDHTrainError:
        raise BDHTrainError(
            f"device {name!r} was asked for but no CUDA device is available; use 'auto' or 'cpu'"
        ) from None


def load_run(
    path: str | os.PathLike[str], device: str | torch.device = "cpu", finite: bool = False
) -> tuple[BDH, Tokenizer | None, RunConfig]:
    """(model in eval mode on `device`, tokenizer, run config) of a finished run.

    `path` is a run directory (its latest checkpoint), a checkpoint directory, or a file
    written by `bdh-train export --ternary`. The tokenizer is the one the run trained with:
    the checkpoint's tokenizer.json (an export's copy in its metadata), else the run
    directory's, else (byte runs, and runs written before tokenizers travelled with them) the
    byte tokenizer for a byte-level token model, else None. When the checkpoint carries the
    tokenizer, the config's data.tokenizer names that copy, so the config works wherever the
    run now is. For an export, which holds the model, tokenizer and the run's [training]
    section, the config is the defaults with those sections. With `finite`, weights holding NaN or
    infinity are refused (NonFiniteModelError naming the checkpoint or export). A BitNet model
    computes with the quantization warm-up's lambda of the checkpoint's step, as training did
    (an export's is fully quantized).
    """
    path = Path(path)
    dev = inference_device(device)
    if path.is_file():
        model = load_ternary(path, dev)
        if finite:
            check_finite_weights(model, f"the export '{path}'")
        cfg = _export_config(path, model.config)
        text = export_tokenizer_json(path)
        if text is None:
            return model, tokenizer_for(model.config), cfg
        exported = HFTokenizer.from_json(text, f"the export '{path}'")
        _check_tokenizer_fits(exported, model.config, f"the export '{path}'")
        return model, exported, cfg
    directory = ckpt.resolve_checkpoint(path)
    try:
        with safe_open(str(directory / ckpt.MODEL_FILE), "pt") as handle:
            meta = handle.metadata() or {}
    except SafetensorError as exc:  # a checkpoint without a manifest is not verified first
        raise CheckpointError(
            f"cannot read {directory / ckpt.MODEL_FILE}: {exc}; it is damaged or not a "
            "safetensors file: pass --checkpoint an intact checkpoint"
        ) from None
    if "bdh_config" not in meta:
        raise CheckpointError(
            f"{directory / ckpt.MODEL_FILE} has no bdh_config metadata; "
            "was it written by bdh-train?"
        )
    try:  # untrusted sizes: validated (and checked against memory) before anything is built
        config = BDHConfig.from_dict(json.loads(meta["bdh_config"]))
    except (BDHTrainError, ValueError, TypeError, RecursionError) as exc:
        raise CheckpointError(
            f"the bdh_config metadata of {directory / ckpt.MODEL_FILE} is unusable: "
            f"{first_line(exc)}"
        ) from None
    # the sizes the config implies against the file's tensors, before the model is allocated
    problems = shape_mismatch(state_shapes(config), ckpt.weight_shapes(directory))
    if problems is not None:
        raise CheckpointError(
            f"the bdh_config metadata of {directory / ckpt.MODEL_FILE} does not fit its "
            f"tensors ({problems}): the file was changed or damaged"
        )
    model = BDH(config)
    ckpt.load_into_model(model, ckpt.load_model_weights(directory), directory)
    model.set_quant_step(_trained_steps(meta, directory))
    if finite:
        check_finite_weights(model, f"checkpoint {directory}")
    copy = run_tokenizer_file(directory)
    tok: Tokenizer | None = tokenizer_for(model.config)
    if copy is not None:
        tok = load_tokenizer(copy)
        _check_tokenizer_fits(tok, model.config, str(copy))
    saved = config_path(directory)
    # The tokenizer the run trained with is the copy found above, wherever the run now is.
    naming_copy = [] if copy is None else [f"data.tokenizer={json.dumps(str(copy.resolve()))}"]
    cfg = (
        load_config([saved], naming_copy, default_preset=False)
        if saved.is_file()
        else RunConfig(model=model.config)
    )
    return model.to(dev).eval(), tok, cfg


def _trained_steps(meta: dict[str, str], directory: Path) -> int:
    """The optimizer steps a checkpoint's weights have taken (its model file's `step`
    metadata; 0 where it has none, as in a merge or grow, which a run starts from): a BitNet
    model computes with the quantization warm-up's lambda of that step, as training did."""
    step = meta.get("step", "0")
    if not (step.isascii() and step.isdigit() and len(step) <= 19):
        raise CheckpointError(
            f"the step metadata of {directory / ckpt.MODEL_FILE} is {step[:40]!r}, not a "
            "number of steps; the file is damaged: pass --checkpoint another checkpoint"
        )
    return int(step)


def _export_config(path: Path, model: BDHConfig) -> RunConfig:
    """The config of an export: the defaults with its model section and the run's [training]
    section (block and batch sizes of evaluation) when the export carries it."""
    text = export_training_json(path)
    if text is None:
        return RunConfig(model=model)
    try:
        training = json.loads(text)
        return RunConfig.from_dict({"model": model.to_dict(), "training": training})
    except (BDHTrainError, ValueError, TypeError, RecursionError) as exc:
        raise CheckpointError(
            f"the training metadata of the export '{path}' is unusable: {first_line(exc)}"
        ) from None


def run_tokenizer_file(checkpoint: Path) -> Path | None:
    """The tokenizer.json a run carries: the checkpoint's own, else its run directory's
    (checkpoint = RUN/checkpoints/step-N); None for byte runs and older runs."""
    candidates = [checkpoint / TOKENIZER_FILE]
    run = run_of_checkpoint(checkpoint)
    if run is not None:
        candidates.append(run.tokenizer_copy)
    return next((c for c in candidates if c.is_file()), None)


def _check_tokenizer_fits(tok: Tokenizer, config: BDHConfig, where: str) -> None:
    if tok.vocab_size != config.vocab_size:
        raise CheckpointError(
            f"the tokenizer of {where} has {tok.vocab_size} ids but the model's vocab_size is "
            f"{config.vocab_size}: the tokenizer does not belong to this model"
        )


def tokenizer_for(config: BDHConfig) -> ByteTokenizer | None:
    """The byte tokenizer for a byte-level token model (vocab 256, token head), else None."""
    if config.vocab_size == 256 and config.language_head.type == "token":
        return ByteTokenizer()
    return None


def config_hash(config: BDHConfig) -> str:
    """SHA-256 of the model config (canonical JSON): what a saved state must match."""
    text = json.dumps(config.to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class Continuation:
    """One sequence read so far: the model's carried state and the output of its last token.

    `feed(ids)` reads tokens on top of what was read; `sample(n, ...)` draws n tokens, each
    fed back as it is drawn. Feeding A then B equals feeding A + B; `BDH.stream_generate` is
    the one-call twin (tests/test_inference.py checks they agree).
    """

    def __init__(self, model: BDH, summary_events: SummaryEvents | None = None) -> None:
        self.model = model
        self.events = summary_events
        self.state: ModelState = model.init_state(1)
        self.hidden: torch.Tensor | None = None
        """[1, 1, D] output of the last token read; None before any."""
        keep = 0 if summary_events is None else summary_events.history_len
        self.recent = torch.full((1, keep), -1, dtype=torch.long, device=self._device)
        """The last history_len tokens (-1 before the start), for the summary-event mask."""

    @property
    def _device(self) -> torch.device:
        return self.model.embed.weight.device

    @property
    def tokens_read(self) -> int:
        return int(self.state.position[0])

    @torch.no_grad()
    def feed(self, ids: torch.Tensor | list[int], executor: str | None = None) -> None:
        """Read `ids` on top of what was read, `PREFILL_TOKENS` at a time (`read_tokens`):
        memory does not grow with their number."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
        if ids.shape[1] == 0:
            return
        hidden, recent = read_tokens(
            self.model, self.state, ids, self.events, self.recent, executor
        )
        self.hidden = hidden.unsqueeze(1)
        if recent is not None:
            self.recent = recent

    @torch.no_grad()
    def sample(
        self,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Iterator[int]:
        """Draw tokens one at a time, each read back in before the next is drawn (one
        recurrent step each, by the fast decoder where it applies: model/generate.py)."""
        if self.hidden is None:
            raise BDHTrainError("nothing has been read yet: give a prompt")
        decoder = make_decoder(self.model, self.state, "auto", self.events, self.recent)
        try:
            for index in range(max_new_tokens):
                logits = self.model.logits_from_hidden(self.hidden)[:, -1].float()
                if index == 0:
                    check_finite_logits(self.model, logits)
                token = sample_next_token(logits, temperature, top_k, generator)
                yield int(token[0])
                self.hidden = decoder.step(token).unsqueeze(1)
                if isinstance(decoder, GenericDecoder) and decoder.recent is not None:
                    self.recent = decoder.recent
        finally:  # the state holds every token read, also when the caller stops early
            if isinstance(decoder, FastDecoder):
                decoder.flush()

    # ------------------------------------------------------------------ state files
    def save(self, path: str | os.PathLike[str], force: bool = False) -> Path:
        """Write the state (fixed size, whatever was read) with the model's config hash, by
        the output policy (`storage.output.write_file`: an existing file only with `force`)."""
        if self.hidden is None:
            raise BDHTrainError("nothing has been read yet: there is no state to save")
        tensors = {f"state.{k}": v.cpu().contiguous() for k, v in self.state.state_dict().items()}
        tensors["hidden"] = self.hidden.detach().cpu().contiguous()
        tensors["recent"] = self.recent.cpu().contiguous()
        meta = {"format": STATE_FORMAT, "config_hash": config_hash(self.model.config)}
        data = safetensors_bytes(tensors, metadata=meta)
        return write_file(path, data, "--save-state", force=force)

    def load(self, path: str | os.PathLike[str]) -> Continuation:
        """Continue from a saved state; refused when it was saved from another model config,
        or when it is not what `save` writes for this model: every tensor of the state of
        one sequence after at least one token, in the shape and kind of dtype that state has,
        finite, at a position of at least 1. The file must be a regular file of at most the
        size such a state takes (`read_regular_file`), so a FIFO, a device or a huge file is
        refused before anything is read."""
        path = Path(path)
        reference = self._reference_state()
        limit = sum(t.numel() * t.element_size() for t in reference.values()) + STATE_HEADER_BYTES
        what = f"state file {path}"
        fix = "give a file written by --save-state for this checkpoint"
        try:
            data = read_regular_file(path, limit, what, CheckpointError, fix)
        except OSError as exc:
            raise CheckpointError(f"cannot read state file {path}: {exc}") from exc
        try:
            tensors = safetensors_load(data)
            header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        except Exception as exc:  # a damaged file: safetensors' own error types
            raise CheckpointError(f"cannot read state file {path}: {first_line(exc)}") from exc
        meta = header.get("__metadata__") or {}
        if meta.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{path} is not a saved generation state (--save-state)")
        if meta.get("config_hash") != config_hash(self.model.config):
            raise CheckpointError(
                f"{path} was saved from a model with another config; load it with the "
                "checkpoint it was saved from"
            )
        _check_state_tensors(path, tensors, reference)
        state = {k.removeprefix("state."): v for k, v in tensors.items() if k.startswith("state.")}
        self.state.load_state_dict(
            {k: v.to(reference[f"state.{k}"].dtype) for k, v in state.items()}
        )
        self.hidden = tensors["hidden"].to(self._device, self.model.embed.weight.dtype)
        self.recent = tensors["recent"].to(self._device)
        return self

    def _reference_state(self) -> dict[str, torch.Tensor]:
        """What `save` writes for this model and summary events: the state after one token."""
        probe = Continuation(self.model, self.events)
        probe.feed([0])
        assert probe.hidden is not None
        tensors = {f"state.{k}": v for k, v in probe.state.state_dict().items()}
        return {**tensors, "hidden": probe.hidden, "recent": probe.recent}


STATE_HEADER_BYTES = 64 << 10
"""What a state file may hold beyond its tensors' bytes: the safetensors header (each
tensor's name, dtype, shape and offsets) and the metadata (format and config hash)."""


def _check_state_tensors(
    path: Path, tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> None:
    """CheckpointError naming `path` and the first thing in which the state file's tensors
    differ from `reference` (a state `save` writes for this model): a missing or unexpected
    tensor, a shape, a kind of dtype (floating or integer), a value that is not finite, a
    position below 1."""
    bad = f"{path} is not a generation state of this checkpoint"
    missing = sorted(set(reference) - set(tensors))
    if missing:
        raise CheckpointError(f"{bad}: it has no tensor {missing[0]!r}")
    unexpected = sorted(set(tensors) - set(reference))
    if unexpected:
        raise CheckpointError(f"{bad}: it has an unexpected tensor {unexpected[0]!r}")
    for name, want in reference.items():
        got = tensors[name]
        if got.shape != want.shape:
            raise CheckpointError(
                f"{bad}: {name!r} has shape {list(got.shape)}, the model's {list(want.shape)}"
            )
        if got.is_floating_point() != want.is_floating_point() or (
            not want.is_floating_point() and got.dtype != want.dtype
        ):
            kind = "a floating dtype" if want.is_floating_point() else str(want.dtype)
            raise CheckpointError(f"{bad}: {name!r} is {got.dtype}, not {kind}")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise CheckpointError(f"{bad}: {name!r} holds NaN or infinity")
    position = int(tensors["state.position"][0])
    if position < 1:
        raise CheckpointError(
            f"{bad}: its position is {position}, and a saved state has read at least 1 token"
        )


def encode_text(tokenizer: Tokenizer, text: str, where: str) -> list[int]:
    """The ids of `text` in `tokenizer`. Bytes that are not UTF-8 reach Python's strings from a
    command line or a stream as lone surrogate escapes, which are no text and which no
    tokenizer encodes: such a text is a DataError that begins with `where`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{where} holds {exc.object[exc.start : exc.end]!r}, which is not text (a lone "
            "surrogate escape); remove it"
        ) from exc
    return tokenizer.encode(text)


@dataclass(frozen=True)
class TextScore:
    """How well a model predicts a text (`score_text`)."""

    loss: float
    """Mean loss in nats per predicted token (every token after the first)."""
    tokens: int
    """Predicted tokens."""
    bits_per_byte: float
    """The summed loss in bits per UTF-8 byte of the predicted tokens."""


SCORE_CHUNK_TOKENS = 1024
"""`score_text` reads a text this many tokens per call, the state carried between calls."""


@torch.no_grad()
def score_text(
    model: BDH, tokenizer: Tokenizer, text: str, chunk_tokens: int = SCORE_CHUNK_TOKENS
) -> TextScore:
    """The loss of `model` on `text` without gradients: each token after the first predicted
    from all the text before it (read `chunk_tokens` at a time with the carried state, so
    memory does not grow with the text), in nats per token and bits per byte."""
    ids = torch.as_tensor(encode_text(tokenizer, text, "the text"), dtype=torch.long)
    if ids.numel() < 2:
        raise DataError(f"the text is {ids.numel()} token(s): scoring needs at least 2")
    device = model.embed.weight.device
    inputs, targets = ids[:-1].to(device), ids[1:].to(device)
    total = 0.0

    def add_loss(start: int, hidden: torch.Tensor) -> None:
        nonlocal total
        wanted = targets[start : start + hidden.shape[1]].unsqueeze(0)
        total += float(model.loss_from_hidden(hidden, wanted, reduction="sum"))

    read_tokens(
        model,
        model.init_state(1),
        inputs.unsqueeze(0),
        chunk_tokens=chunk_tokens,
        on_hidden=add_loss,
    )
    lengths = torch.as_tensor(tokenizer.token_byte_lengths(), dtype=torch.int64)
    text_bytes = int(lengths[targets.cpu()].sum())
    return TextScore(total / targets.numel(), targets.numel(), bits_per_byte(total, text_bytes))


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
