"""Output heads: the token head (logits = hidden @ lm_head) and the NCA factorized patch head.

The NCA head predicts a patch of P = p*p cells,
each with S states, as P independent S-way softmaxes instead of one softmax over all S**P
patch ids: `nca_lm_head` [D, P*S] (column c*S + s = cell c, state s). Frame/EOS tokens get their
own small softmax over `nca_special_head` [D, #specials]. There are no flat token logits, so
`BDH.logits_from_hidden` and generation are unavailable with this head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bdh_train.batch import IGNORE_INDEX
from bdh_train.model.config import LanguageHeadConfig

REDUCTIONS = ("mean", "sum")


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """Losses are computed in float32 at least (bf16 log-softmax is too coarse), fp64 kept."""
    return t if t.dtype == torch.float64 else t.float()


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def token_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy over counted targets (!= IGNORE_INDEX), computed in float32 at least."""
    _check_reduction(reduction)
    return F.cross_entropy(
        _upcast(logits.reshape(-1, logits.shape[-1])),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def patch_digits(ids: torch.Tensor, state_count: int, cells: int) -> torch.Tensor:
    """Patch ids [...] -> cell states [..., P], base S, cell 0 the most significant digit."""
    powers = state_count ** torch.arange(cells - 1, -1, -1, device=ids.device)
    return torch.div(ids.unsqueeze(-1), powers, rounding_mode="floor") % state_count


def _nca_target_classes(
    targets: torch.Tensor, head: LanguageHeadConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat targets -> (is_patch, special index or -1): the NCA head's two kinds of target."""
    t = targets.reshape(-1).to(dtype=torch.long)
    is_patch = (t >= 0) & (t < head.patch_vocab)
    specials = head.special_tokens
    if not specials:
        return is_patch, torch.full_like(t, -1)
    table = torch.full((max(specials) + 1,), -1, dtype=torch.long, device=t.device)
    table[torch.tensor(specials, device=t.device)] = torch.arange(len(specials), device=t.device)
    in_table = (t >= 0) & (t < table.shape[0]) & ~is_patch
    return is_patch, torch.where(in_table, table[torch.where(in_table, t, 0)], -1)


def counted_target_mask(targets: torch.Tensor, head: LanguageHeadConfig) -> torch.Tensor:
    """Which targets the head's loss counts (flattened, bool): the token head counts every
    target but IGNORE_INDEX; the NCA head counts patch ids and its special tokens only.

    A 'mean' loss is its 'sum' divided by max(1, this count), so a train step that weights
    pieces or micro-batches by this count reproduces the head's mean exactly.
    """
    if head.type == "token":
        return targets.reshape(-1) != IGNORE_INDEX
    is_patch, special_index = _nca_target_classes(targets, head)
    return is_patch | (special_index >= 0)


def count_targets(targets: torch.Tensor, head: LanguageHeadConfig) -> float:
    """The number of targets the head's loss counts: a batch's weight in token-weighted
    accumulation and the denominator of its mean loss (see `counted_target_mask`)."""
    return float(counted_target_mask(targets, head).sum().item())


def nca_factorized_loss(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    patch_head: torch.Tensor,
    special_head: torch.Tensor | None,
    head: LanguageHeadConfig,
    reduction: str = "mean",
) -> torch.Tensor:
    """The NCA loss: sum of per-target nll / max(1, number of counted targets).

    A target t < K costs the sum over cells of -log_softmax(h @ W_fact as [P, S])[c, digit_c];
    a special target costs -log_softmax(h @ W_special)[its index]. Those are the counted
    targets (`counted_target_mask`); any other id (IGNORE_INDEX included) contributes 0 and is
    not counted. With data from `bdh_train.data.nca` every non-ignored target is counted.
    reduction 'sum' returns the plain sum (for exact token-weighted accumulation).
    """
    _check_reduction(reduction)
    s, p = head.state_count, head.cells
    if head.special_tokens and special_head is None:
        raise ValueError(
            f"the head has special tokens {head.special_tokens} but no special_head was given"
        )
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(device=h.device, dtype=torch.long)
    is_patch, special_index = _nca_target_classes(t, head)
    patch_logp = F.log_softmax(_upcast(h @ patch_head).view(-1, p, s), dim=-1)
    digits = patch_digits(torch.where(is_patch, t, 0), s, p)
    patch_nll = -patch_logp.gather(-1, digits.unsqueeze(-1)).squeeze(-1).sum(-1)
    nll = torch.where(is_patch, patch_nll, 0.0)
    is_special = special_index >= 0
    if special_head is not None and head.special_tokens:
        special_logp = F.log_softmax(_upcast(h @ special_head), dim=-1)
        index = special_index.clamp_min(0).unsqueeze(-1)
        special_nll = -special_logp.gather(-1, index).squeeze(-1)
        nll = nll + torch.where(is_special, special_nll, 0.0)
    total = nll.sum()
    if reduction == "sum":
        return total
    return total / (is_patch | is_special).sum().clamp_min(1)
