"""Recording a model's neurons over a stream of tokens: `ActivityCounts` (model/activity.py)
plus, per token, the share of neurons with x > 0, and per neuron of one layer its
`top_k` largest x and the tokens they were on and the sum of its x over every token (what
the neuron dashboards show and rank by).

`record_activity` runs the model's own forward over rows of tokens with the recorder set
(`recording`); nothing of the layer's arithmetic is repeated here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bdh_train.model.activity import ActivityCounts, recording
from bdh_train.model.bdh import BDH


class InspectRecorder(ActivityCounts):
    """`ActivityCounts`, the per-token x share of every layer, and the top x and the summed x
    of each neuron at `dashboard_layer`. `offset` is the position, in the inspected stream,
    of the current call's first token; a call's rows are consecutive stretches of the
    stream."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        n_neurons: int,
        dashboard_layer: int,
        top_k: int,
        device: torch.device | str = "cpu",
    ):
        super().__init__(n_layer, n_head, n_neurons, device)
        self.dashboard_layer, self.top_k = dashboard_layer, top_k
        self.offset = 0
        self.token_share: list[list[torch.Tensor]] = [[] for _ in range(n_layer)]
        """Per layer, pieces of [tokens] shares of all heads' neurons with x > 0."""
        self.top_values = torch.empty(n_head, 0, n_neurons, device=device)
        self.top_tokens = torch.empty(n_head, 0, n_neurons, dtype=torch.int64, device=device)
        self.x_sum = torch.zeros(n_head, n_neurons, dtype=torch.float64, device=device)
        """[H, N] each neuron's x summed over every token of `dashboard_layer`."""

    def record(self, x: torch.Tensor, pre: torch.Tensor) -> None:
        x, pre = x.detach().float(), pre.detach().float()
        super().record(x, pre)
        batch, heads, seq_len, n = x.shape
        share = (x > 0).double().mean(dim=(1, 3))  # [B, T]
        self.token_share[self.layer].append(share.reshape(-1))
        if self.layer != self.dashboard_layer:
            return
        values = x.permute(1, 0, 2, 3).reshape(heads, batch * seq_len, n)
        self.x_sum += values.sum(dim=1, dtype=torch.float64)
        tokens = self.offset + torch.arange(batch * seq_len, device=x.device)
        values = torch.cat([self.top_values, values], dim=1)
        tokens = torch.cat([self.top_tokens, tokens.view(1, -1, 1).expand(heads, -1, n)], dim=1)
        keep = min(self.top_k, values.shape[1])
        self.top_values, index = values.topk(keep, dim=1)
        self.top_tokens = tokens.gather(1, index)

    def token_shares(self) -> torch.Tensor:
        """[L, tokens] share of the neurons (all heads) with x > 0 on each token."""
        return torch.stack([torch.cat(pieces).cpu() for pieces in self.token_share])


def record_activity(
    model: BDH,
    tokens: torch.Tensor,
    block_size: int,
    batch_size: int,
    recorder: InspectRecorder,
    progress: Callable[[int], None] | None = None,
) -> InspectRecorder:
    """Read `tokens` [T] in rows of `block_size` (each from a fresh state; a shorter last row
    alone), `batch_size` rows a call, recording every layer; `progress(tokens)` after each."""
    model.eval()
    device = model.embed.weight.device
    full = tokens.numel() // block_size * block_size
    rows = tokens[:full].view(-1, block_size)
    calls = [rows[i : i + batch_size] for i in range(0, rows.shape[0], batch_size)]
    if full < tokens.numel():
        calls.append(tokens[full:].view(1, -1))
    with torch.no_grad(), recording(model, recorder):
        for call in calls:
            model.forward_hidden(call.to(device))
            recorder.offset += call.numel()
            if progress is not None:
                progress(call.numel())
    return recorder
