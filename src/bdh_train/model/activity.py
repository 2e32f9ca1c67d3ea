"""What the layer's neurons do, recorded from the model's own forward.

`BDH.recorder`, when set, is handed every layer call's neurons x = relu(u @ encoder) and gate
input pre = a @ encoder_v (both [B, H, T, N]) after `BDH.layer` has set `recorder.layer` to the
layer's index. `recording` sets it for a `with` block. Nothing is recomputed: the recorder sees
the tensors the layer itself goes on with.

`ActivityCounts` counts, per layer and head, the positive entries of x, of yg = relu(pre) and
of x * yg (what reaches the decoder), and per neuron the tokens on which x > 0. From these:
the three activities (share of positive entries), dead neurons (x never > 0 on the recorded
tokens) and always-on neurons (x > 0 on more than half of them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from bdh_train.model.bdh import BDH, ActivationRecorder

ACTIVITIES = ("x", "y", "xy")
"""The recorded activities: x, yg = relu(a @ encoder_v), and x * yg."""


@contextlib.contextmanager
def recording(model: BDH, recorder: ActivationRecorder) -> Iterator[ActivationRecorder]:
    """`model.recorder = recorder` inside the block (the previous one restored after it)."""
    previous, model.recorder = model.recorder, recorder
    try:
        yield recorder
    finally:
        model.recorder = previous


class ActivityCounts:
    """Counts of positive activations per layer and head (and x's per neuron), summed over
    every recorded token: `shares`, `dead` and `always_on` turn them into the statistics."""

    def __init__(self, n_layer: int, n_head: int, n_neurons: int, device: Any = "cpu"):
        self.layer = 0
        self.n_neurons = n_neurons
        shape = (n_layer, n_head)
        self.positive = {
            name: torch.zeros(shape, dtype=torch.int64, device=device) for name in ACTIVITIES
        }
        self.tokens = torch.zeros(n_layer, dtype=torch.int64, device=device)
        self.fires = torch.zeros((*shape, n_neurons), dtype=torch.int64, device=device)
        """[L, H, N]: tokens on which neuron (h, n) had x > 0 at layer l."""

    def record(self, x: torch.Tensor, pre: torch.Tensor) -> None:
        """Add one layer call's counts (x, pre: [B, H, T, N])."""
        # 0/1 floats sum faster than bools; each float sum below runs over at most T or N
        # entries, so it is exact (below 2**24) before the integer sums take over
        fires_x, fires_y = (x > 0).float(), (pre > 0).float()
        per_neuron = fires_x.sum(2).long().sum(0)  # [H, N]
        layer = self.layer
        self.fires[layer] += per_neuron
        self.positive["x"][layer] += per_neuron.sum(-1)
        self.positive["y"][layer] += fires_y.sum(-1).long().sum(dim=(0, 2))
        self.positive["xy"][layer] += (fires_x * fires_y).sum(-1).long().sum(dim=(0, 2))
        self.tokens[layer] += x.shape[0] * x.shape[2]

    def counts(self) -> list[torch.Tensor]:
        """Every count, in a fixed order (what data-parallel ranks add together)."""
        return [*(self.positive[name] for name in ACTIVITIES), self.tokens, self.fires]

    def set_counts(self, counts: list[torch.Tensor]) -> None:
        """Replace the counts by `counts` (as `counts` orders them), e.g. summed over ranks."""
        *positive, self.tokens, self.fires = counts
        self.positive = dict(zip(ACTIVITIES, positive, strict=True))

    def shares(self) -> dict[str, torch.Tensor]:
        """Activity name -> [L, H] share of that layer and head's entries that are > 0."""
        entries = (self.tokens * self.n_neurons).clamp(min=1).unsqueeze(1)
        return {name: self.positive[name].double() / entries for name in ACTIVITIES}

    def dead(self) -> torch.Tensor:
        """[L, H] share of the head's neurons whose x was never > 0 at that layer."""
        return (self.fires == 0).double().mean(-1)

    def always_on_neurons(self) -> torch.Tensor:
        """[L, H, N] whether the neuron's x was > 0 on more than half the tokens."""
        return 2 * self.fires > self.tokens.view(-1, 1, 1)

    def always_on(self) -> torch.Tensor:
        """[L, H] share of the head's neurons whose x was > 0 on more than half the tokens."""
        return self.always_on_neurons().double().mean(-1)

    def tables(self) -> dict[str, torch.Tensor]:
        """Every statistic as [L, H]: the activities (`shares`), `dead` and `always_on`."""
        return self.shares() | {"dead": self.dead(), "always_on": self.always_on()}

    def row(self) -> dict[str, float]:
        """The metrics-row numbers: each statistic over all layers and heads (`x_active`,
        `y_active`, `xy_active`, `dead`, `always_on`) and per layer (`x_active_l0`, ...)."""
        out: dict[str, float] = {}
        for name, table in self.tables().items():
            key = f"{name}_active" if name in ACTIVITIES else name
            out[key] = float(table.mean())
            for layer, value in enumerate(table.mean(-1).tolist()):
                out[f"{key}_l{layer}"] = value
        return out
