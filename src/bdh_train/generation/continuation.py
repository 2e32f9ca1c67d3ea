"""A `Continuation` carries the model's fixed-size state between calls (what `bdh-train chat`
and `generate --save-state/--load-state` are built on), and the state file that saves one.

A BDH's whole past is its recurrent state: a few tensors per layer whose size does not grow
with the text read. A continuation fed A and then B is the model fed A + B, so a chat turn or
a cached prompt costs only its own tokens. A state file is checked when it is loaded: its
format, the model config's hash and every tensor's shape.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes

from bdh_train.errors import BDHTrainError, CheckpointError
from bdh_train.model import BDH, ModelState
from bdh_train.model.decoders import FastDecoder, GenericDecoder, make_decoder
from bdh_train.model.sampling import read_tokens, sample_tokens
from bdh_train.model.summary import SummaryEvents
from bdh_train.shared.loading import config_hash
from bdh_train.storage.output import write_file
from bdh_train.utils import first_line, read_regular_file

STATE_FORMAT = "bdh-state/1"


class Continuation:
    """One sequence read so far: the model's carried state and the output of its last token.

    `feed(ids)` reads tokens on top of what was read; `sample(n, ...)` draws n tokens, each
    fed back as it is drawn. Feeding A then B equals feeding A + B; `sampling.stream_generate`
    is the one-call twin (tests/generation/test_continuation.py checks they agree).
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
        """Draw tokens one at a time, each read back in before the next is drawn: the
        generation loop (`model/sampling.sample_tokens`), one recurrent step a token by the
        fast decoder where it applies. A token the caller stops at is not read."""
        if self.hidden is None:
            raise BDHTrainError("nothing has been read yet: give a prompt")
        decoder = make_decoder(self.model, self.state, "auto", self.events, self.recent)

        def read(hidden: torch.Tensor) -> None:
            self.hidden = hidden.unsqueeze(1)
            if isinstance(decoder, GenericDecoder) and decoder.recent is not None:
                self.recent = decoder.recent

        steps = sample_tokens(
            self.model,
            decoder,
            self.hidden[:, -1],
            max_new_tokens,
            temperature,
            top_k,
            generator,
            read_last=True,
            on_read=read,
        )
        try:
            for token in steps:
                yield int(token[0])
        finally:  # the state holds every token read, also when the caller stops early
            steps.close()
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
