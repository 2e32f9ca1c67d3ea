"""Synapses: the state after reading a text, read between neurons, and the concept probe.

The state of layer l is rho[h] [N, D] per head; sigma[h] = rho[h] @ encoder_v[h] [N, N]:
entry (i, j) is how much neuron i's past activity, through the state, now drives y-neuron j.
Read from a fresh state, sigma starts at 0, so its largest entries are the synapses the text
strengthened most. Under `rope` the state holds rotated keys (pairs of neurons 2k, 2k+1 rotate
together), so a per-neuron reading is exact only under `alibi`; the report says which.

sigma is never built whole: the probe reads the synapses among `neurons` (per head, the
`size` neurons whose state rows have the largest norm summed over the probe's texts), a
[size, size] block per head, size^2 * D multiply-adds a text and head.

The concept probe: texts with the concept and without it; in each class, texts at even
positions train and odd ones are held out, at least `MIN_PER_HALF` of each class in each
half. Each synapse's separation on the training texts is (mean_with - mean_without) / the
standard deviation of its value over all training texts (both classes; 0 for a synapse equal
on all of them), so |separation| <= 2 with as many texts of each class, 2 when each class is
constant. The synapses of largest |separation| are scored on the held-out texts by ROC AUC of
the value times the sign of its separation: 1 when every held-out text lies on the side the
training texts put its class (for a synapse weaker with the concept, every held-out text with
it below every one without), 0 the reverse, 0.5 chance. A synapse unrelated to the concept
reaches 1 with probability 1 / C(with + without, with) over the held-out texts (`chance_auc_1`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bdh_train.errors import BDHTrainError
from bdh_train.model.bdh import BDH
from bdh_train.model.sampling import read_tokens


def read_state(model: BDH, ids: list[int], layer: int) -> torch.Tensor:
    """rho of `layer` [H, N, D] after the model reads `ids` from a fresh state, PREFILL_TOKENS
    at a time (`read_tokens`), so the memory of reading a prompt does not grow with it."""
    model.eval()
    state = model.init_state(1)
    with torch.no_grad():
        read_tokens(model, state, torch.tensor([ids], dtype=torch.int64))
    rho = state.rho[layer]
    assert rho is not None  # written by the forward over at least one token
    return rho[0].float()


def synapses(
    rho: torch.Tensor, encoder_v: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """sigma[h][rows][:, cols] = rho[h][rows] @ encoder_v[h][:, cols] for every head:
    rho [H, N, D], encoder_v [H, D, N], rows [H, R], cols [H, C] -> [H, R, C]."""
    picked_rho = torch.stack([rho[h][rows[h]] for h in range(rho.shape[0])])
    picked_enc = torch.stack([encoder_v[h][:, cols[h]] for h in range(rho.shape[0])])
    return picked_rho @ picked_enc.to(picked_rho)


def strongest(sigma: torch.Tensor, count: int) -> list[tuple[int, int, int, float]]:
    """The `count` largest entries of sigma [H, R, C] as (head, row, col, value)."""
    flat = sigma.reshape(-1)
    values, index = flat.topk(min(count, flat.numel()))
    r, c = sigma.shape[1], sigma.shape[2]
    return [
        (int(i // (r * c)), int(i // c % r), int(i % c), float(v))
        for v, i in zip(values.tolist(), index.tolist(), strict=True)
    ]


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC of `scores` for binary `labels`: the Mann-Whitney statistic, the chance that a
    positive outscores a negative (ties count one half), from average ranks."""
    positive = labels.bool()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("ROC AUC needs both classes")
    order = scores.double().argsort()
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    sorted_scores = scores.double()[order]
    for value in sorted_scores.unique():  # ties share their average rank
        tied = scores.double() == value
        ranks[tied] = ranks[tied].mean()
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


MIN_PER_HALF = 2
"""Texts of each class in each half (training, held out) the concept probe needs: with one,
the spread within a class is 0 and a held-out ROC AUC can only be 0 or 1."""


@dataclass
class ProbeResult:
    """The concept probe's synapses: feature index, separation on the training texts, and
    held-out ROC AUC (oriented by the separation's sign)."""

    features: list[int]
    separation: list[float]
    held_out_auc: list[float]
    train_counts: tuple[int, int]
    held_out_counts: tuple[int, int]

    @property
    def chance_auc_1(self) -> float:
        """The probability that a synapse unrelated to the concept (its held-out values in a
        random order) reaches held-out ROC AUC 1: one ordering of C(with + without, with)."""
        with_concept, without = self.held_out_counts
        return 1 / math.comb(with_concept + without, with_concept)


def check_probe_classes(labels: list[bool]) -> None:
    """Refuse a probe without `MIN_PER_HALF` texts of each class in each half."""
    with_concept = sum(labels)
    without = len(labels) - with_concept
    need = 2 * MIN_PER_HALF
    if with_concept < need or without < need:
        raise BDHTrainError(
            f"the concept probe needs at least {need} prompts with the concept and {need} "
            f"without ({MIN_PER_HALF} of each to choose synapses, {MIN_PER_HALF} held out; "
            f"with fewer the spread within a class is 0 and a held-out ROC AUC only 0 or 1), "
            f"got {with_concept} with and {without} without: add prompts marked "
            '"concept": true and false'
        )


def separation(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[F] (mean with - mean without) / std over all texts of `features` [texts, F] (fp64),
    0 where a feature is equal on every text."""
    x = features.double()
    difference = x[labels].mean(0) - x[~labels].mean(0)
    spread = x.std(0, unbiased=False)
    return torch.where(spread > 0, difference / spread.clamp(min=1e-300), 0.0)


def concept_probe(features: torch.Tensor, labels: list[bool], count: int = 10) -> ProbeResult:
    """The `count` features [texts, F] that best separate the labelled texts, chosen on the
    texts at even positions of each class and judged on the odd ones (`roc_auc`)."""
    check_probe_classes(labels)
    label = torch.tensor(labels)
    train, held = [], []
    for cls in (True, False):
        members = [i for i, value in enumerate(labels) if value == cls]
        train += members[0::2]
        held += members[1::2]
    x_train, y_train = features[train].double(), label[train]
    separated = separation(x_train, y_train)
    chosen = separated.abs().topk(min(count, separated.numel())).indices
    x_held, y_held = features[held].double(), label[held]
    aucs = [roc_auc(x_held[:, f] * separated[f].sign(), y_held) for f in chosen.tolist()]
    return ProbeResult(
        chosen.tolist(),
        separated[chosen].tolist(),
        aucs,
        (int(y_train.sum()), int((~y_train).sum())),
        (int(y_held.sum()), int((~y_held).sum())),
    )


def probe_neurons(states: list[torch.Tensor], size: int) -> torch.Tensor:
    """[H, size] per head the neurons whose state rows (rho[h][i] [D]) have the largest norm
    summed over `states` (each [H, N, D])."""
    weight = sum(state.norm(dim=-1) for state in states)
    assert isinstance(weight, torch.Tensor)
    return weight.topk(min(size, weight.shape[-1]), dim=-1).indices.sort(dim=-1).values


def synapse_report(
    model: BDH,
    prompts: list[list[int]],
    labels: list[bool] | None,
    layer: int,
    size: int = 64,
    count: int = 10,
    texts: list[str] | None = None,
) -> dict[str, Any]:
    """The synapses of `layer` among `probe_neurons`: the strongest after each prompt (each
    named by its text: `texts`, else its token ids) and, with `labels`, the concept probe
    over all heads' [size, size] blocks."""
    if labels is not None:
        check_probe_classes(labels)
    states = [read_state(model, ids, layer) for ids in prompts]
    neurons = probe_neurons(states, size)
    encoder_v = model.encoder_v.detach().float()
    blocks = torch.stack([synapses(rho, encoder_v, neurons, neurons) for rho in states])
    r = blocks.shape[2]
    named = [
        [
            {"head": h, "from": int(neurons[h, i]), "to": int(neurons[h, j]), "value": v}
            for h, i, j, v in strongest(block, count)
        ]
        for block in blocks
    ]
    if texts is None:
        texts = [" ".join(map(str, ids)) for ids in prompts]
    out: dict[str, Any] = {
        "layer": layer,
        "neurons_per_head": r,
        "prompts": texts,
        "strongest": named,
    }
    if labels is not None:
        probe = concept_probe(blocks.reshape(len(prompts), -1), labels, count)
        out["probe"] = {
            "train_texts": list(probe.train_counts),
            "held_out_texts": list(probe.held_out_counts),
            "chance_auc_1": probe.chance_auc_1,
            "synapses": [
                {
                    "head": f // (r * r),
                    "from": int(neurons[f // (r * r), f // r % r]),
                    "to": int(neurons[f // (r * r), f % r]),
                    "separation": s,
                    "held_out_auc": a,
                }
                for f, s, a in zip(
                    probe.features, probe.separation, probe.held_out_auc, strict=True
                )
            ],
        }
    return out
