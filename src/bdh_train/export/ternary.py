"""`bdh-train export --ternary`: a BitNet-trained run written as one ternary file (the format
and its loader are `storage/ternary.py`). The export always uses full quantization, whatever
the run's warm-up step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from bdh_train.data.tokenizer import HFTokenizer
from bdh_train.errors import ConfigError
from bdh_train.model.bdh import BDH
from bdh_train.model.config import BDHConfig
from bdh_train.model.quant import PROJECTION_TARGETS, TERNARY_FORMATS, quantize_weight
from bdh_train.shared.loading import load_run
from bdh_train.storage.output import check_output, write_file
from bdh_train.storage.run_dir import check_outside_checkpoints
from bdh_train.storage.ternary import (
    FORMAT,
    PACKED_SUFFIX,
    SCALE_SUFFIX,
    TOKENIZER_KEY,
    TRAINING_KEY,
    pack_ternary,
)


def _targeted(config: BDHConfig) -> list[str]:
    """BDH parameter names of the quantized projections, in a fixed order."""
    targets = config.quant.target_modules
    return [name for name, paper in PROJECTION_TARGETS.items() if paper in targets]


def export_ternary(
    model: BDH,
    out_path: str | os.PathLike[str],
    tokenizer_json: str | None = None,
    training_json: str | None = None,
    force: bool = False,
) -> Path:
    """Write `model` as a packed ternary safetensors file; returns the path. The file is
    written by the output policy (`storage.output.write_file`): an existing one is replaced
    only with `force`, and only a regular file.

    `tokenizer_json` (the run's tokenizer.json text) is stored in the metadata, so the export
    alone decodes (`export_tokenizer_json`); None for the byte tokenizer, which needs no file.
    `training_json` (the run's ``[training]`` section as JSON) is stored too, so evaluating
    the export uses the run's block and batch sizes (`export_training_json`).

    Needs a model configured for ternary QAT (quant.enable with a ternary weight_format);
    exporting a float model would silently destroy it.
    """
    config = model.config
    q = config.quant
    if not q.enable or q.weight_format not in TERNARY_FORMATS:
        raise ConfigError(
            "export --ternary needs a model trained with model.quant.enable = true and "
            f"model.quant.weight_format in {TERNARY_FORMATS}, got enable={q.enable}, "
            f"weight_format={q.weight_format!r}"
        )
    targeted = _targeted(config)
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for name, param in model.state_dict().items():
        if name in targeted:
            codes, scale = quantize_weight(param, q.weight_format)
            tensors[name + PACKED_SUFFIX] = pack_ternary(codes).cpu()
            tensors[name + SCALE_SUFFIX] = scale.reshape(1).to(torch.float32).cpu()
            shapes[name] = list(param.shape)
        else:
            tensors[name] = param.detach().cpu().contiguous()
    metadata = {
        "format": FORMAT,
        "config": json.dumps(config.to_dict()),
        "ternary": json.dumps(shapes),
    }
    if tokenizer_json is not None:
        metadata[TOKENIZER_KEY] = tokenizer_json
    if training_json is not None:
        metadata[TRAINING_KEY] = training_json
    data = safetensors_bytes(tensors, metadata=metadata)
    return write_file(out_path, data, "OUT", force=force)


def export_run_ternary(
    source: str | os.PathLike[str], out_path: str | os.PathLike[str], force: bool = False
) -> Path:
    """`bdh-train export --ternary RUN OUT`: the model of `source` (a run directory, a
    checkpoint or a ternary export) written by `export_ternary` with the run's tokenizer.json
    (an HF tokenizer's) and its ``[training]`` section. OUT is checked by the output policy
    (and kept outside the checkpoints read) before anything is loaded."""
    check_outside_checkpoints(Path(source), out_path)
    check_output(out_path, "OUT", force=force)
    model, tok, cfg = load_run(source)
    tokenizer_json = tok.to_json() if isinstance(tok, HFTokenizer) else None
    training_json = json.dumps(cfg.to_dict()["training"])
    return export_ternary(model, out_path, tokenizer_json, training_json, force=force)
