"""Loading a finished run for use: `load_run` (a run directory, checkpoint or ternary export
-> model, tokenizer, config; the checkpoint's tokenizer copy, else the run's, else the byte
tokenizer), the device it runs on, and `encode_text`, a text's token ids (a text that is not UTF-8
is refused). Every application that reads a trained model starts here."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from bdh_train.config import RunConfig, load_config
from bdh_train.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from bdh_train.distributed.env import resolve_device
from bdh_train.errors import BDHTrainError, CheckpointError, DataError
from bdh_train.model import BDH, BDHConfig
from bdh_train.model.bdh import shape_mismatch, state_shapes
from bdh_train.model.sampling import check_finite_weights
from bdh_train.model.summary import SummaryEvents
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage.run_dir import config_path, run_of_checkpoint
from bdh_train.storage.ternary import export_tokenizer_json, export_training_json, load_ternary
from bdh_train.utils import first_line


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
    key = ckpt.MODEL_CONFIG_KEY
    if key not in meta:
        raise CheckpointError(
            f"{directory / ckpt.MODEL_FILE} has no {key} metadata; was it written by bdh-train?"
        )
    try:  # untrusted sizes: validated (and checked against memory) before anything is built
        config = BDHConfig.from_dict(json.loads(meta[key]))
    except (BDHTrainError, ValueError, TypeError, RecursionError) as exc:
        raise CheckpointError(
            f"the {key} metadata of {directory / ckpt.MODEL_FILE} is unusable: {first_line(exc)}"
        ) from None
    # the sizes the config implies against the file's tensors, before the model is allocated
    problems = shape_mismatch(state_shapes(config), ckpt.weight_shapes(directory))
    if problems is not None:
        raise CheckpointError(
            f"the {key} metadata of {directory / ckpt.MODEL_FILE} does not fit its "
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


LATER_FIELDS = {"token_shift": False}
"""Model config fields added after saved states began to carry `config_hash`, with the value
every earlier model had: at that value they are left out of the hash, so a state saved
before the field existed still matches its model."""


def config_hash(config: BDHConfig) -> str:
    """SHA-256 of the model config (canonical JSON): what a saved state must match."""
    fields = {
        key: value
        for key, value in config.to_dict().items()
        if key not in LATER_FIELDS or value != LATER_FIELDS[key]
    }
    text = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def summary_events(model: BDH, config: RunConfig) -> SummaryEvents | None:
    """The run's summary trigger when the model's summary memory has a write gate."""
    return config.data.summary_trigger() if model.config.summary_memory.write_gate else None


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
