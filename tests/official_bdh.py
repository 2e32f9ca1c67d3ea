"""What the official pathwaycom/bdh code builds, for tests that load official checkpoints."""

from __future__ import annotations

import math

import torch


def official_frequencies_buffer(n_neurons: int) -> torch.Tensor:
    """The `attn.freqs` buffer as the official code builds it ([1, 1, 1, N], float32)."""
    i = torch.arange(n_neurons, dtype=torch.float32)
    return (1.0 / (2.0**16) ** ((i / 2).floor() * 2 / n_neurons) / (2 * math.pi)).view(
        1, 1, 1, n_neurons
    )
