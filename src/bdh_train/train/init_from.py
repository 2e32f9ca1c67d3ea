"""Start a run from weights trained elsewhere (`checkpoint.init_from`): our own checkpoints or
an official pathwaycom/bdh `.pt` state_dict, with `training.init_transfer` deciding which parts
keep their fresh initialisation and how the transferred backbone's gradients are scaled."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bdh_train import checks
from bdh_train.errors import CheckpointError
from bdh_train.model import BDH, groups
from bdh_train.model.official import load_official_checkpoint
from bdh_train.storage import checkpoint as ckpt

OFFICIAL_SUFFIXES = (".pt", ".pth", ".bin")
"""A file with one of these suffixes is read as an official torch state_dict."""


@dataclass
class InitTransferConfig:
    """How to treat weights loaded with ``checkpoint.init_from`` during the first steps."""

    backbone_grad_scale: float | None = None
    """Multiply the backbone's gradients by this (None: no scaling)."""
    backbone_grad_scale_steps: int = 0
    """For how many optimizer steps the scaling applies (0: not at all); an accumulation window
    of several micro-batches is one step."""
    preserve_fresh_decoder: bool = False
    """Keep the fresh decoder instead of the loaded one."""
    preserve_fresh_norm: bool = False
    """Keep the fresh normalization parameters instead of the loaded ones."""

    def validate(self, prefix: str = "training.init_transfer") -> InitTransferConfig:
        if self.backbone_grad_scale is not None:
            checks.number(f"{prefix}.backbone_grad_scale", self.backbone_grad_scale, low=0.0)
        checks.nonneg_int(f"{prefix}.backbone_grad_scale_steps", self.backbone_grad_scale_steps)
        checks.boolean(f"{prefix}.preserve_fresh_decoder", self.preserve_fresh_decoder)
        checks.boolean(f"{prefix}.preserve_fresh_norm", self.preserve_fresh_norm)
        return self


def init_weights_from(model: BDH, transfer: InitTransferConfig, source: str | Path) -> list[str]:
    """Load weights only into `model` and return the names that were kept fresh.

    A preserved-fresh decoder/norm keeps its fresh init. Interface parameters whose shapes
    differ (e.g. another vocabulary) stay fresh; a mis-shaped backbone parameter is an error.
    """
    path = Path(source)
    if path.is_file() and path.suffix in OFFICIAL_SUFFIXES:
        weights = load_official_checkpoint(path, model.config.n_layer).state_dict()
    else:
        weights = ckpt.load_model_weights(ckpt.resolve_checkpoint(path))
    surface = set(groups.interface_surface_params(model))
    fresh = set()
    if transfer.preserve_fresh_decoder:
        fresh.add("decoder")
    if transfer.preserve_fresh_norm:
        fresh |= set(groups.params_for_target(model, "normalization"))
    own = model.state_dict()
    update = {}
    for name, tensor in own.items():
        if name in fresh or name not in weights:
            fresh.add(name)
            continue
        if weights[name].shape != tensor.shape:
            if name in surface:
                fresh.add(name)
                continue
            raise CheckpointError(
                f"init_from {source}: backbone parameter {name} has shape "
                f"{list(weights[name].shape)}, the model needs {list(tensor.shape)}"
            )
        update[name] = weights[name]
    model.load_state_dict({**own, **update})
    return sorted(fresh)
