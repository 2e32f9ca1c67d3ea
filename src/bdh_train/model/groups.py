"""Parameter groups: gradient-scale targets and the transfer surface/backbone split."""

from __future__ import annotations

from torch import nn

TARGETS = (
    "embedding",
    "normalization",
    "output_head",
    "shared_lowrank_encoder",
    "shared_lowrank_decoder",
    "shared_lowrank_decay",
    "other_backbone",
)
SHARED_LOWRANK = ("decay_log_gain", "encoder", "encoder_v", "decoder")
"""The shared low-rank slots a continual-backprop target scale averages over, the learned
decay first; a model without the learned decay (position other than alibi_learned) still has
the slot, at scale 1."""
_TARGET_OF = {
    "embed.weight": "embedding",
    "norm.weight": "normalization",
    "norm.bias": "normalization",
    "lm_head": "output_head",
    "nca_lm_head": "output_head",
    "nca_special_head": "output_head",
    "encoder": "shared_lowrank_encoder",
    "encoder_v": "shared_lowrank_encoder",
    "decoder": "shared_lowrank_decoder",
    "decay_log_gain": "shared_lowrank_decay",  # only with model.position = "alibi_learned"
}


def target_of(name: str) -> str:
    """The gradient-scale target a parameter belongs to; unknown names are other_backbone."""
    return _TARGET_OF.get(name, "other_backbone")


def params_for_target(model: nn.Module, target: str) -> list[str]:
    if target not in TARGETS:
        raise ValueError(f"unknown parameter-group target {target!r}; expected one of {TARGETS}")
    return [name for name, _ in model.named_parameters() if target_of(name) == target]


def interface_surface_params(
    model: nn.Module, preserve_fresh_decoder: bool = False, preserve_fresh_norm: bool = False
) -> list[str]:
    """embed ∪ output heads ∪ (norm if preserve_fresh_norm) ∪ (decoder if preserve_fresh_decoder):
    the parameters that stay fresh when a backbone is transferred from another model."""
    surface = []
    for name, _ in model.named_parameters():
        target = target_of(name)
        if (
            target in ("embedding", "output_head")
            or (target == "normalization" and preserve_fresh_norm)
            or (name == "decoder" and preserve_fresh_decoder)
        ):
            surface.append(name)
    return surface


def transferred_backbone_params(
    model: nn.Module, preserve_fresh_decoder: bool = False, preserve_fresh_norm: bool = False
) -> list[str]:
    """All parameters minus the interface surface."""
    surface = set(interface_surface_params(model, preserve_fresh_decoder, preserve_fresh_norm))
    return [name for name, _ in model.named_parameters() if name not in surface]
