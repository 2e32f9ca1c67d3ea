"""The ternary file (`bdh-ternary/1`): a BitNet-trained BDH as 2-bit packed weights in one
safetensors file, and its loader.

Targeted projections are stored as their ternary codes, 4 per byte, plus one float32
scale gamma each: 1/16 of their float32 size. Every other tensor (embedding, head, untargeted
projections, norm) stays float. The BDHConfig rides along as JSON metadata, so the file alone
rebuilds the model, and so does the run's tokenizer.json (when it has one), so the file alone
decodes its tokens. Loading gives an inference model that runs the targeted projections as
integer matmuls on the stored codes, with the same logits as the fake-quant model at lambda = 1.
Every size in the metadata is checked before a tensor is allocated.

Packing: code c in {-1, 0, +1} is stored as c + 1 in 2 bits; element 4i + j of the flattened
tensor occupies bits 2j..2j+1 of byte i (little-endian within the byte); the tail is padded
with code 0.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from bdh_train.errors import CheckpointError
from bdh_train.model.bdh import BDH, shape_mismatch, state_shapes
from bdh_train.model.config import BDHConfig

FORMAT = "bdh-ternary/1"
TOKENIZER_KEY = "tokenizer"
"""The metadata key holding the text of the run's tokenizer.json (absent for byte models)."""
TRAINING_KEY = "training"
"""The metadata key holding the run's [training] section as JSON (absent in older exports)."""
PACKED_SUFFIX = ".ternary"
SCALE_SUFFIX = ".scale"


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """Ternary codes (any shape, values in {-1, 0, 1}) -> uint8 [ceil(numel / 4)]."""
    flat = codes.detach().reshape(-1).to(torch.int16)
    if flat.numel() and (flat.abs() > 1).any():
        raise ValueError("pack_ternary needs codes in {-1, 0, 1}")
    pad = (-flat.numel()) % 4
    two_bits = torch.nn.functional.pad(flat + 1, (0, pad), value=1).view(-1, 4)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int16, device=flat.device)
    return (two_bits << shifts).sum(dim=1).to(torch.uint8)


def unpack_ternary(packed: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of pack_ternary: uint8 [ceil(numel / 4)] -> int8 codes of `shape`."""
    numel = 1
    for n in shape:
        numel *= int(n)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int16, device=packed.device)
    two_bits = (packed.to(torch.int16).unsqueeze(1) >> shifts) & 3
    if two_bits.numel() < numel:
        raise CheckpointError(f"packed ternary tensor too short for shape {list(shape)}")
    return (two_bits.reshape(-1)[:numel] - 1).to(torch.int8).reshape(tuple(shape))


def _is_safetensors(path: Path) -> bool:
    """Whether `path` begins as a safetensors file does: an 8-byte little-endian header
    length that fits in the file, then the header's JSON object."""
    with open(path, "rb") as handle:
        head = handle.read(9)
    if len(head) < 9:
        return False
    length = int.from_bytes(head[:8], "little")
    return 8 + length <= path.stat().st_size and head[8:9] == b"{"


def _read_export(
    path: Path, with_tensors: bool = True
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of an export, refused unless it is one; tensors only when asked."""
    if not path.is_file():
        raise CheckpointError(f"ternary export '{path}' does not exist")
    if not _is_safetensors(path):
        raise CheckpointError(
            f"'{path}' is neither a checkpoint nor a ternary export (not a safetensors file): "
            "give a run directory, a checkpoint directory or a file written by "
            "`bdh-train export --ternary`"
        )
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            keys = list(f.keys()) if with_tensors else []
            tensors = {k: f.get_tensor(k) for k in keys}
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"cannot read ternary export '{path}': {exc}") from exc
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"'{path}' is not a {FORMAT} export (format={metadata.get('format')!r})"
        )
    return metadata, tensors


def export_tokenizer_json(path: str | os.PathLike[str]) -> str | None:
    """The tokenizer.json text an export carries, or None (a byte model's export)."""
    return _read_export(Path(path), with_tensors=False)[0].get(TOKENIZER_KEY)


def export_training_json(path: str | os.PathLike[str]) -> str | None:
    """The run's [training] section (JSON) an export carries, or None (an older export)."""
    return _read_export(Path(path), with_tensors=False)[0].get(TRAINING_KEY)


def metadata_json(metadata: dict[str, str], key: str, path: Path) -> Any:
    """The JSON value an export's metadata holds at `key`; CheckpointError (one line) when it
    is missing, not JSON, or nested too deep for the parser."""
    if key not in metadata:
        raise CheckpointError(f"ternary export '{path}' has no {key!r} metadata")
    try:
        return json.loads(metadata[key])
    except (ValueError, RecursionError) as exc:
        what = "nested too deep" if isinstance(exc, RecursionError) else f"not JSON ({exc})"
        raise CheckpointError(
            f"the {key!r} metadata of the ternary export '{path}' is {what}: the file was "
            "changed or damaged"
        ) from None


def _ternary_shapes(metadata: dict[str, str], path: Path) -> dict[str, tuple[int, ...]]:
    """The shapes of the packed projections the export's metadata lists."""
    listed = metadata_json(metadata, "ternary", path)
    if not isinstance(listed, dict) or not all(
        isinstance(v, list) and all(type(n) is int and n >= 0 for n in v) for v in listed.values()
    ):
        raise CheckpointError(
            f"the 'ternary' metadata of the ternary export '{path}' is no table of tensor "
            "shapes: the file was changed or damaged"
        )
    return {k: tuple(v) for k, v in listed.items()}


def _check_sizes(
    config: BDHConfig,
    shapes: dict[str, tuple[int, ...]],
    tensors: dict[str, torch.Tensor],
    path: Path,
) -> None:
    """Refuse, before the model is allocated, an export whose config does not fit its
    tensors: the packed projections' listed shapes, the bytes that pack them and every float
    tensor's shape against the sizes the config implies (`state_shapes`)."""
    held = {k: tuple(v.shape) for k, v in tensors.items() if not k.endswith(_STORED_SUFFIXES)}
    for name, shape in shapes.items():
        held[name] = shape
        packed, scale = tensors.get(name + PACKED_SUFFIX), tensors.get(name + SCALE_SUFFIX)
        numel = math.prod(shape)
        if (
            packed is None
            or scale is None
            or packed.numel() != -(-numel // 4)
            or scale.numel() != 1
        ):
            raise CheckpointError(
                f"ternary export '{path}': {name} is listed as {list(shape)} but its packed "
                "codes or scale do not hold that: the file was changed or damaged"
            )
    problems = shape_mismatch(state_shapes(config), held)
    if problems is not None:
        raise CheckpointError(
            f"the config of the ternary export '{path}' does not fit its tensors ({problems}): "
            "the file was changed or damaged"
        )


_STORED_SUFFIXES = (PACKED_SUFFIX, SCALE_SUFFIX)


def load_ternary(path: str | os.PathLike[str], device: torch.device | str = "cpu") -> BDH:
    """Rebuild the inference model from an `export_ternary` file (eval mode, lambda = 1).

    The targeted projections run from the stored integer codes; their float parameters hold
    the dequantized values codes * gamma for inspection only.
    """
    path = Path(path)
    metadata, tensors = _read_export(path)
    config = BDHConfig.from_dict(metadata_json(metadata, "config", path))
    shapes = _ternary_shapes(metadata, path)
    _check_sizes(config, shapes, tensors, path)
    model = BDH(config).to(tensors["embed.weight"].dtype)
    state = {}
    frozen = {}
    for name, shape in shapes.items():
        codes = unpack_ternary(tensors.pop(name + PACKED_SUFFIX), shape)
        scale = tensors.pop(name + SCALE_SUFFIX).reshape(())
        frozen[name] = (codes, scale)
        state[name] = codes.to(scale.dtype) * scale
    state.update(tensors)
    model.load_state_dict(state)
    if model.quantizer is None:
        raise CheckpointError(f"ternary export '{path}' has a config without quantization")
    for name, (codes, scale) in frozen.items():
        model.quantizer.freeze_weight(name, codes, scale)
    model.set_quant_step(config.quant.warmup_steps)
    return model.to(device).eval()
