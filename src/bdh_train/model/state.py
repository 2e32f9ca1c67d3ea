"""ModelState: what a BDH carries from one call to the next.

One `rho` per layer ([B, H, N, D], None until first written) and a per-row absolute position
([B] long), so rows of one batch may be at different points of their documents. Operations
rebind tensors rather than writing into them, so a state can sit inside an autograd graph.
"""

from __future__ import annotations

import torch

from bdh_train.errors import CheckpointError


class ModelState:
    def __init__(self, n_layer: int, batch_size: int, device: torch.device | str = "cpu"):
        self.rho: list[torch.Tensor | None] = [None] * n_layer
        self.position = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def n_layer(self) -> int:
        return len(self.rho)

    @property
    def batch_size(self) -> int:
        return int(self.position.shape[0])

    def detach_(self) -> ModelState:
        """Cut the autograd graph, keep the values: how TBPTT truncates."""
        self.rho = [None if r is None else r.detach() for r in self.rho]
        return self

    def reset_(self, rows: torch.Tensor | None = None) -> ModelState:
        """Zero the state of the rows in the boolean mask `rows` (all rows when None)."""
        if rows is None:
            rows = torch.ones_like(self.position, dtype=torch.bool)
        rows = rows.to(device=self.position.device, dtype=torch.bool)
        if rows.shape != self.position.shape:
            raise ValueError(
                f"reset mask must have shape [{self.batch_size}], got {tuple(rows.shape)}"
            )
        keep = ~rows
        self.rho = [None if r is None else r * keep.view(-1, 1, 1, 1).to(r.dtype) for r in self.rho]
        self.position = self.position.masked_fill(rows, 0)
        return self

    def to(self, device: torch.device | str) -> ModelState:
        self.rho = [None if r is None else r.to(device) for r in self.rho]
        self.position = self.position.to(device)
        return self

    def clone(self) -> ModelState:
        other = ModelState(self.n_layer, self.batch_size, self.position.device)
        other.rho = [None if r is None else r.clone() for r in self.rho]
        other.position = self.position.clone()
        return other

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensor dict (safetensors-friendly): 'position' and 'rho.<layer>'."""
        out = {"position": self.position.detach().clone()}
        for layer, r in enumerate(self.rho):
            if r is not None:
                out[f"rho.{layer}"] = r.detach().clone()
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> ModelState:
        """Restore from `state_dict()`; validates everything before changing anything."""
        if "position" not in sd:
            raise CheckpointError("model state checkpoint has no 'position' entry")
        position = sd["position"]
        if position.dim() != 1 or position.dtype != torch.long:
            raise CheckpointError(
                f"model state 'position' must be a 1-D long tensor, got {tuple(position.shape)} "
                f"{position.dtype}"
            )
        rho: list[torch.Tensor | None] = [None] * self.n_layer
        for key, value in sd.items():
            if key == "position":
                continue
            prefix, _, index = key.partition(".")
            if prefix != "rho" or not index.isdigit() or int(index) >= self.n_layer:
                raise CheckpointError(
                    f"unexpected model state entry {key!r} for a {self.n_layer}-layer model"
                )
            if value.dim() != 4 or value.shape[0] != position.shape[0]:
                raise CheckpointError(
                    f"model state {key!r} must be [B, H, N, D] with B={position.shape[0]}, "
                    f"got {tuple(value.shape)}"
                )
            rho[int(index)] = value.to(self.position.device)
        self.rho = rho
        self.position = position.to(self.position.device).clone()
        return self
