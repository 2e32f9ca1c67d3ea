"""ModelState: what a BDH carries from one call to the next.

One `rho` per layer ([B, H, N, D], None until first written), one summary-memory carry per
layer that has one (`SummaryCarry`, None until first written or for layers without), under
`model.token_shift` each layer's input at the last token read (`previous`, [B, 1, 1, D]) and a
per-row absolute position ([B] long), so rows of one batch may be at different points of their
documents. Operations rebind tensors rather than writing into them, so a state can sit inside
an autograd graph.
"""

from __future__ import annotations

import torch

from bdh_train.errors import CheckpointError
from bdh_train.model.summary import SummaryCarry

SUMMARY_KEYS = {name: f"summary_{name}" for name in SummaryCarry._fields}
"""SummaryCarry field -> its state_dict key prefix ('summary_memory.<layer>', ...)."""


def _map_carry(carry: SummaryCarry | None, fn) -> SummaryCarry | None:
    return None if carry is None else SummaryCarry(*(fn(t) for t in carry))


def _written(rho: torch.Tensor | None) -> torch.Tensor:
    """`rho` where the caller's contract says it is set (a fully written state)."""
    assert rho is not None
    return rho


class ModelState:
    """What a BDH carries from one call to the next, for a batch of rows: `rho` (one per
    layer, None until first written), `summary` (one summary-memory carry per layer, None
    until written or for layers without one), `previous` (one per layer: its input u at the
    last token read [B, 1, 1, D], which the token shift adds to the next token's; None until
    written or without the shift) and `position` (each row's absolute position, [B] long).
    `state_dict` and `load_state_dict` save and restore it as flat tensors."""

    def __init__(self, n_layer: int, batch_size: int, device: torch.device | str = "cpu"):
        self.rho: list[torch.Tensor | None] = [None] * n_layer
        self.summary: list[SummaryCarry | None] = [None] * n_layer
        self.previous: list[torch.Tensor | None] = [None] * n_layer
        self.position = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def n_layer(self) -> int:
        return len(self.rho)

    @property
    def batch_size(self) -> int:
        return int(self.position.shape[0])

    def detach_(self) -> ModelState:
        """Cut the autograd graph, keep the values: how TBPTT truncates."""
        self._map_into(self, torch.Tensor.detach)
        return self

    def _map_into(self, target: ModelState, fn) -> None:
        """Set `target`'s per-layer tensors (rho, summary carries, previous) to `fn` of this
        state's, keeping the Nones (detach_, to, clone and select_rows_)."""
        target.rho = [None if r is None else fn(r) for r in self.rho]
        target.summary = [_map_carry(c, fn) for c in self.summary]
        target.previous = [None if p is None else fn(p) for p in self.previous]

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

        def zero_rows(t: torch.Tensor) -> torch.Tensor:
            return torch.where(rows.view(-1, *[1] * (t.dim() - 1)), torch.zeros_like(t), t)

        self.summary = [_map_carry(c, zero_rows) for c in self.summary]
        self.previous = [None if p is None else zero_rows(p) for p in self.previous]
        self.position = self.position.masked_fill(rows, 0)
        return self

    def to(self, device: torch.device | str) -> ModelState:
        self._map_into(self, lambda t: t.to(device))
        self.position = self.position.to(device)
        return self

    def clone(self) -> ModelState:
        other = ModelState(self.n_layer, self.batch_size, self.position.device)
        self._map_into(other, torch.Tensor.clone)
        other.position = self.position.clone()
        return other

    @classmethod
    def concat(cls, states: list[ModelState]) -> ModelState:
        """One batch holding the rows of `states` in order (each fully written: every rho and
        summary carry set, as after a forward call with the state)."""
        first = states[0]
        out = cls(first.n_layer, 0, first.position.device)
        out.rho = [
            None if first.rho[i] is None else torch.cat([_written(s.rho[i]) for s in states])
            for i in range(first.n_layer)
        ]
        for i, carry in enumerate(first.summary):
            if carry is not None:
                fields = zip(*(s.summary[i] for s in states), strict=True)
                out.summary[i] = SummaryCarry(*(torch.cat(parts) for parts in fields))
        out.previous = [
            None if p is None else torch.cat([_written(s.previous[i]) for s in states])
            for i, p in enumerate(first.previous)
        ]
        out.position = torch.cat([s.position for s in states])
        return out

    def select_rows_(self, rows: torch.Tensor) -> ModelState:
        """Keep only the rows at the indices `rows` (long [B'], in that order)."""
        self._map_into(self, lambda t: t.index_select(0, rows))
        self.position = self.position.index_select(0, rows)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensor dict (safetensors-friendly): 'position', 'rho.<layer>', under the token
        shift 'previous.<layer>' and, for layers with a summary memory,
        'summary_memory.<layer>', 'summary_chunk_sum.<layer>' and 'summary_chunk_hits.<layer>'."""
        out = {"position": self.position.detach().clone()}
        for layer, r in enumerate(self.rho):
            if r is not None:
                out[f"rho.{layer}"] = r.detach().clone()
        for layer, p in enumerate(self.previous):
            if p is not None:
                out[f"previous.{layer}"] = p.detach().clone()
        for layer, carry in enumerate(self.summary):
            if carry is not None:
                for name, t in carry._asdict().items():
                    out[f"{SUMMARY_KEYS[name]}.{layer}"] = t.detach().clone()
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
        previous: list[torch.Tensor | None] = [None] * self.n_layer
        summary: list[dict[str, torch.Tensor]] = [{} for _ in range(self.n_layer)]
        summary_fields = {key: name for name, key in SUMMARY_KEYS.items()}
        for key, value in sd.items():
            if key == "position":
                continue
            prefix, _, index = key.partition(".")
            if (
                prefix not in ("rho", "previous", *summary_fields)
                or not index.isdigit()
                or int(index) >= self.n_layer
            ):
                raise CheckpointError(
                    f"unexpected model state entry {key!r} for a {self.n_layer}-layer model"
                )
            if prefix in summary_fields:
                summary[int(index)][summary_fields[prefix]] = _checked_carry_entry(
                    key, summary_fields[prefix], value, int(position.shape[0])
                )
                continue
            if prefix == "previous":
                checked = _checked_carry_entry(key, prefix, value, int(position.shape[0]))
                previous[int(index)] = checked.to(self.position.device)
                continue
            if value.dim() != 4 or value.shape[0] != position.shape[0]:
                raise CheckpointError(
                    f"model state {key!r} must be [B, H, N, D] with B={position.shape[0]}, "
                    f"got {tuple(value.shape)}"
                )
            rho[int(index)] = value.to(self.position.device)
        carries: list[SummaryCarry | None] = [None] * self.n_layer
        for layer, parts in enumerate(summary):
            if not parts:
                continue  # a state saved without a summary memory starts it fresh
            if len(parts) != len(SummaryCarry._fields):
                missing = sorted(SUMMARY_KEYS[n] for n in SummaryCarry._fields if n not in parts)
                raise CheckpointError(
                    f"model state layer {layer} has a partial summary memory: missing "
                    f"{', '.join(f'{m}.{layer}' for m in missing)}"
                )
            carries[layer] = SummaryCarry(
                **{n: t.to(self.position.device) for n, t in parts.items()}
            )
        self.rho = rho
        self.summary = carries
        self.previous = previous
        self.position = position.to(self.position.device).clone()
        return self


def _checked_carry_entry(key: str, name: str, value: torch.Tensor, batch: int) -> torch.Tensor:
    """A per-row carry of the shape its field `name` has: a summary carry's ([B, 1, 1, D], or
    [B] long for chunk_hits) or the token shift's 'previous' ([B, 1, 1, D])."""
    if name == "chunk_hits":
        ok, shape = value.shape == (batch,) and value.dtype == torch.long, f"[{batch}] long"
    else:
        ok, shape = value.dim() == 4 and value.shape[:3] == (batch, 1, 1), f"[{batch}, 1, 1, D]"
    if not ok:
        raise CheckpointError(
            f"model state {key!r} must be {shape}, got {tuple(value.shape)} {value.dtype}"
        )
    return value
