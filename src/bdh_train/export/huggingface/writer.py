"""`bdh-train export --hf DIR`: a run, a checkpoint or a ternary export as a Hugging Face
transformers model directory that loads with no bdh-train installed:

    config.json              model_type "bdh", auto_map to the custom code below
    model.safetensors        the weights (and the rope frequencies, float64)
    configuration_bdh.py     the custom code, copied from this package: torch + transformers
    modeling_bdh.py
    tokenizer.json           the run's tokenizer for `AutoTokenizer` (the byte tokenizer as a
    tokenizer_config.json    byte-level vocabulary of 256 ids)
    special_tokens_map.json
    generation_config.json
    README.md                a model card: what was trained, on what, for how long, final losses

The directory is written whole into a temporary sibling and renamed at the end, so a refused
or failed export leaves nothing. A model trained quantized (BitNet) is written with its
quantized weight values, and the custom code rounds the projections' inputs as training did
(int8 per token); what the custom code cannot compute is refused: the NCA head, the summary
memory, per-tensor activation scales, a quantization warm-up caught mid-way.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from bdh_train.config import RunConfig
from bdh_train.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    byte_level_alphabet,
)
from bdh_train.errors import BDHTrainError, CheckpointError
from bdh_train.model import BDH
from bdh_train.model.quant import PROJECTION_TARGETS
from bdh_train.shared.loading import load_run
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage.output import check_output, publish_dir, writing
from bdh_train.storage.run_dir import check_outside_checkpoints, run_of_checkpoint
from bdh_train.train.metrics import read_metrics
from bdh_train.train.state import TRAINER_FILE

CODE_FILES = ("configuration_bdh.py", "modeling_bdh.py")
"""The custom code, files of this package copied into the export as they are."""
WEIGHTS_FILE = "model.safetensors"
MODEL_MAX_LENGTH = 10**30
"""What tokenizer_config.json gives as the longest input: none (the state has a fixed size)."""
BYTE_PAD = 0
"""The byte tokenizer's padding id: byte 0, which padding never makes the model read."""


@dataclass
class Provenance:
    """What the model card says about where the model comes from."""

    exported_from: str
    data: str | None = None
    steps: int | None = None
    tokens: int | None = None
    block_size: int | None = None
    batch_size: int | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    bits_per_byte: float | None = None


def export_hf(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the model of `source` (a run directory, a checkpoint or a ternary export file)
    as a transformers model directory `out`, which must not exist; returns its path."""
    source, out = Path(source), Path(out)
    check_output(out, "--hf", force=None, directory=True)
    check_outside_checkpoints(source, out)
    model, tok, cfg = load_run(source, finite=True)
    check_exportable(model, tok, source)
    assert tok is not None  # check_exportable refuses a model without one
    files: dict[str, bytes] = {
        WEIGHTS_FILE: safetensors_bytes(hf_tensors(model), metadata={"format": "pt"}),
        **{name: resources.files(__package__).joinpath(name).read_bytes() for name in CODE_FILES},
    }
    texts = tokenizer_files(tok)
    eos, pad = special_ids(tok)
    texts["config.json"] = _json(hf_config(model, eos, pad))
    texts["generation_config.json"] = _json(
        {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None, "do_sample": False}
    )
    texts["README.md"] = model_card(model, tok, provenance(source, cfg), out.name)
    files.update({name: text.encode("utf-8") for name, text in texts.items()})
    return write_directory(out, files)


def check_exportable(model: BDH, tok: Tokenizer | None, source: Path) -> None:
    """Refuse, with what to do instead, a model the custom code does not compute."""
    c = model.config
    refusal = None
    if c.language_head.type != "token":
        refusal = f"has the {c.language_head.type!r} head, which gives no token logits"
    elif c.summary_memory.enabled:
        refusal = "has a summary memory (model.summary_memory.enabled), which it does not carry"
    elif model.quantizer is not None and c.quant.act_format != "int8":
        refusal = (
            f"rounds activations with one scale per tensor (model.quant.act_format = "
            f"{c.quant.act_format!r}), which depends on how a text is cut into calls"
        )
    elif model.quantizer is not None and 0.0 < model.quantizer.lam < 1.0:
        refusal = (
            f"is in its quantization warm-up (lambda = {model.quantizer.lam:g}): export a "
            "checkpoint from after model.quant.warmup_steps"
        )
    elif tok is None:
        refusal = (
            "has no text tokenizer (no tokenizer.json, and not a byte model): a Hugging Face "
            "model needs one"
        )
    if refusal is not None:
        raise BDHTrainError(f"cannot export {source} for Hugging Face: the model {refusal}")


def quantized_projections(model: BDH) -> list[str]:
    """The projections the model computes quantized (none at lambda 0)."""
    q = model.quantizer
    if q is None or q.lam == 0.0:
        return []
    return [name for name in PROJECTION_TARGETS if q.applies_to(name)]


def hf_tensors(model: BDH) -> dict[str, torch.Tensor]:
    """The weights under the custom code's names (the model's own under `model.`, the head
    as `lm_head`), quantized projections as their quantized values."""
    quantized = quantized_projections(model)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name in quantized:
            assert model.quantizer is not None
            tensor = model.quantizer.quantized_weight(name, tensor)
        key = name if name == "lm_head" else f"model.{name}"
        tensors[key] = tensor.detach().cpu().contiguous()
    return tensors


def hf_config(model: BDH, eos: int | None, pad: int) -> dict:
    """config.json: the custom code's BDHConfig, and bdh-train's model config for reference."""
    c = model.config
    return {
        "architectures": ["BDHForCausalLM"],
        "model_type": "bdh",
        "auto_map": {
            "AutoConfig": "configuration_bdh.BDHConfig",
            "AutoModelForCausalLM": "modeling_bdh.BDHForCausalLM",
        },
        "vocab_size": c.vocab_size,
        "n_layer": c.n_layer,
        "n_embd": c.n_embd,
        "n_head": c.n_head,
        "n_neurons": c.n_neurons,
        "position": c.position,
        "norm": c.norm,
        "norm_eps": model.norm_eps,
        "quant_targets": quantized_projections(model),
        "token_shift": c.token_shift,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "bos_token_id": None,
        "dtype": str(model.embed.weight.dtype).removeprefix("torch."),
        "bdh_train_model": c.to_dict(),
    }


def byte_tokenizer_json() -> str:
    """The byte tokenizer as a `tokenizers` tokenizer: the 256 byte-level characters as the
    vocabulary (character of byte b -> id b), no merges, so a text's ids are its UTF-8 bytes."""
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in enumerate(byte_level_alphabet())}
    tok = _HF(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def special_ids(tok: Tokenizer) -> tuple[int | None, int]:
    """(end-of-text id or None, padding id): the padding id is the end-of-text token where
    there is one, else byte 0."""
    if tok.eot_id is not None:
        return tok.eot_id, tok.eot_id
    return None, BYTE_PAD


def tokenizer_files(tok: Tokenizer) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json of `tok`."""
    eos, pad = special_ids(tok)
    if isinstance(tok, HFTokenizer):
        from tokenizers import Tokenizer as _HF

        spec = tok.to_json()
        text_of = _HF.from_str(spec).id_to_token
        special = {"eos_token": None if eos is None else text_of(eos), "pad_token": text_of(pad)}
        split = False
    elif isinstance(tok, ByteTokenizer):
        spec = byte_tokenizer_json()
        special = {"eos_token": None, "pad_token": byte_level_alphabet()[BYTE_PAD]}
        # Text that holds the padding character is still read as its bytes.
        split = True
    else:
        raise BDHTrainError(f"a {type(tok).__name__} cannot be written as Hugging Face files")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": split,
        **special,
    }
    tokens_map = {k: v for k, v in special.items() if v is not None}
    return {
        TOKENIZER_FILE: spec,
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(tokens_map),
    }


def provenance(source: Path, cfg: RunConfig) -> Provenance:
    """Where the model comes from: for a run or checkpoint, its data, steps and last losses
    (from the checkpoint's counters and the run's metrics.jsonl); for a ternary export,
    only the file (it holds no training record)."""
    if source.is_file():
        return Provenance(exported_from=f"the ternary export {source.name}")
    directory = ckpt.resolve_checkpoint(source)
    found = Provenance(
        exported_from=f"checkpoint {directory.name}",
        data=cfg.data.source,
        block_size=cfg.training.block_size,
        batch_size=cfg.training.batch_size,
    )
    try:
        counters = ckpt.read_json(directory / TRAINER_FILE)
        found.steps, found.tokens = int(counters["step"]), int(counters["tokens"])
    except (CheckpointError, ValueError, KeyError, TypeError):
        return found
    run = run_of_checkpoint(directory)
    if run is None or not run.metrics.is_file():
        return found
    for row in read_metrics(run.metrics):
        if row.get("step", found.steps + 1) > found.steps:
            continue
        if "loss" in row:
            found.train_loss = row["loss"]
        if "val_loss" in row:
            found.val_loss, found.bits_per_byte = row["val_loss"], row.get("bits_per_byte")
    return found


_MARKDOWN_PUNCTUATION = re.compile(r"""([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~])""")


def markdown_text(text: str) -> str:
    """`text` as one line of literal Markdown: control characters (newlines) as JSON
    escapes, every ASCII punctuation mark backslash-escaped, so no heading, link, HTML tag
    or code span can start in it."""
    one_line = json.dumps(text, ensure_ascii=False)[1:-1]
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", one_line)


def _figure(value: float | int | None, fmt: str = "") -> str:
    return "not recorded" if value is None else format(value, fmt)


def model_card(model: BDH, tok: Tokenizer, p: Provenance, name: str) -> str:
    """README.md of the export: what was trained, on what, for how long, the final losses,
    and how to load it."""
    c = model.config
    quantized = quantized_projections(model)
    tokenizer = "bytes (256 ids)" if tok.kind == "bytes" else f"a BPE of {tok.vocab_size} ids"
    # a fence longer than any run of backticks in the directory's name, which it holds
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", repr(name))), default=0))
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [bdh, dragon-hatchling, bdh-train, custom_code]",
        "---",
        f"# {markdown_text(name)}",
        "",
        "A Dragon Hatchling (BDH) language model trained with bdh-train and exported from "
        f"{markdown_text(p.exported_from)}. Its whole past is a fixed-size state (one matrix "
        "per layer), so a generated token costs the same however long the text.",
        "",
        "## Model",
        f"- {model.config.parameter_count():,} parameters: {c.n_layer} layers sharing one "
        f"set of weights, n_embd {c.n_embd}, {c.n_head} heads of {c.n_neurons} neurons",
        f"- positions: {c.position}; norm: {c.norm}; token shift: "
        f"{'yes' if c.token_shift else 'no'}; tokenizer: {tokenizer}",
        "- quantized (BitNet b1.58) projections: "
        + (", ".join(quantized) if quantized else "none"),
        "",
        "## Training",
        f"- data: {markdown_text(p.data) if p.data else 'not recorded'}",
        f"- steps: {_figure(p.steps, ',')}; tokens: {_figure(p.tokens, ',')}; "
        f"block size {_figure(p.block_size)}, batch size {_figure(p.batch_size)}",
        f"- final train loss: {_figure(p.train_loss, '.4f')} nats per token",
        f"- final validation loss: {_figure(p.val_loss, '.4f')} nats per token "
        f"({_figure(p.bits_per_byte, '.4f')} bits per byte)",
        "",
        "## Use",
        fence + "python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"tokenizer = AutoTokenizer.from_pretrained({name!r}, trust_remote_code=True)",
        f"model = AutoModelForCausalLM.from_pretrained({name!r}, trust_remote_code=True)",
        'ids = tokenizer("The ", return_tensors="pt")',
        "out = model.generate(**ids, max_new_tokens=100, do_sample=False)",
        "print(tokenizer.decode(out[0]))",
        fence,
        "",
    ]
    return "\n".join(lines)


def write_directory(out: Path, files: dict[str, bytes]) -> Path:
    """Write `files` into a new directory `out` by the output policy's `publish_dir`: built
    beside it and renamed at the end, so `out` never exists half-written, and a write that
    fails names its file."""

    def write(building: Path) -> None:
        for name, data in files.items():
            with writing(building / name), open(building / name, "xb") as handle:
                handle.write(data)

    return publish_dir(out, write, "--hf", "export --hf")


def _json(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"
