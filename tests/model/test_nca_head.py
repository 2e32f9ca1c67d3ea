"""The NCA factorized patch head: parameters, the loss against a hand computation,
the model entry points, and config validation."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_model

from bdh_train.batch import IGNORE_INDEX
from bdh_train.errors import ConfigError
from bdh_train.model import BDH, BDHConfig, LanguageHeadConfig, sampling
from bdh_train.model.heads import (
    count_targets,
    counted_target_mask,
    nca_factorized_loss,
    patch_digits,
)


def nca_head(**kw) -> LanguageHeadConfig:
    base = dict(
        type="nca_factorized_patch",
        state_count=2,
        patch_size=2,
        frame_special_tokens=True,
        eos_id=18,
    )
    base.update(kw)
    return LanguageHeadConfig(**base)


def nca_model(dtype=torch.float64, vocab_size=20, **head) -> BDH:
    return tiny_model(dtype, vocab_size=vocab_size, language_head=nca_head(**head))


def hand_loss(hidden, targets, w_fact, w_special, s, p_cells, specials):
    """The NCA loss written with python loops and math.log/exp, one target at a time."""
    k = s**p_cells
    total, counted = 0.0, 0

    def log_softmax_at(logits, i):
        m = max(logits)
        return logits[i] - m - math.log(sum(math.exp(v - m) for v in logits))

    for h, t in zip(hidden.tolist(), targets.tolist(), strict=True):
        if 0 <= t < k:
            row = [sum(h[d] * w_fact[d][j] for d in range(len(h))) for j in range(p_cells * s)]
            for c in range(p_cells):
                digit = (t // s ** (p_cells - 1 - c)) % s
                total -= log_softmax_at(row[c * s : (c + 1) * s], digit)
            counted += 1
        elif t in specials:
            row = [sum(h[d] * w_special[d][j] for d in range(len(h))) for j in range(len(specials))]
            total -= log_softmax_at(row, specials.index(t))
            counted += 1
    return total, counted


def test_parameters_replace_lm_head():
    model = nca_model()
    names = dict(model.named_parameters())
    assert "lm_head" not in names
    assert names["nca_lm_head"].shape == (16, 4 * 2)  # [D, P*S]
    assert names["nca_special_head"].shape == (16, 3)  # K, K+1, eos
    assert 0.015 < names["nca_lm_head"].std().item() < 0.025
    plain = nca_model(frame_special_tokens=False, eos_id=None, vocab_size=16)
    assert "nca_special_head" not in dict(plain.named_parameters())
    assert model.init_state(2).position.tolist() == [0, 0]


def test_patch_digits_are_base_s_most_significant_first():
    assert patch_digits(torch.tensor([11]), 2, 4).tolist() == [[1, 0, 1, 1]]
    assert patch_digits(torch.tensor([5, 26]), 3, 3).tolist() == [[0, 1, 2], [2, 2, 2]]


def test_loss_equals_hand_computation_with_specials_eos_ignored_and_unknown_ids():
    torch.manual_seed(0)
    model = nca_model()  # S=2, p=2 -> K=16; specials [16, 17, 18]; id 19 is none of them
    hidden = torch.randn(1, 8, 16, dtype=torch.float64)
    targets = torch.tensor([[16, 0, 11, 15, 17, 18, IGNORE_INDEX, 19]])
    head = model.config.language_head
    total, counted = hand_loss(
        hidden[0],
        targets[0],
        model.nca_lm_head.tolist(),
        model.nca_special_head.tolist(),
        2,
        4,
        head.special_tokens,
    )
    assert counted == 6  # the ignored target and id 19 are not counted
    loss = model.loss_from_hidden(hidden, targets)
    assert loss.item() == pytest.approx(total / counted, rel=1e-12)
    assert model.loss_from_hidden(hidden, targets, "sum").item() == pytest.approx(total, rel=1e-12)
    none = torch.full_like(targets, IGNORE_INDEX)
    assert model.loss_from_hidden(hidden, none).item() == 0.0  # divided by max(1, 0)
    with pytest.raises(ValueError, match="reduction"):
        model.loss_from_hidden(hidden, targets, "max")


def test_forward_returns_no_logits_and_the_head_loss():
    model = nca_model()
    idx = torch.tensor([[16, 0, 1, 17, 16, 2, 3, 18]])
    targets = torch.tensor([[0, 1, 17, 18, 2, 3, 16, 18]])
    logits, loss = model(idx, targets)
    assert logits is None
    expected = model.loss_from_hidden(model.forward_hidden(idx), targets)
    assert torch.equal(loss, expected)
    assert model(idx) == (None, None)
    loss.backward()
    assert model.nca_lm_head.grad.abs().sum() > 0 and model.nca_special_head.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="no flat token logits"):
        model.logits_from_hidden(model.forward_hidden(idx))
    with pytest.raises(ValueError, match="generation are unavailable"):
        sampling.generate(model, idx, 2)


def test_split_calls_with_state_equal_the_full_loss():
    """The reference train step's TBPTT check: two chunks through the state give the full loss."""
    model = nca_model()
    idx = torch.tensor([[16, 0, 1, 17], [16, 2, 3, 18]])
    targets = torch.tensor([[0, 1, 17, 18], [2, 3, 16, 18]])
    full = model(idx, targets)[1]
    state = model.init_state(2)
    parts = [
        model.loss_from_hidden(model.forward_hidden(idx[:, sl], state), targets[:, sl], "sum")
        for sl in (slice(0, 2), slice(2, 4))
    ]
    torch.testing.assert_close(sum(parts) / 8, full, rtol=0, atol=1e-12)


def test_float32_loss_matches_float64():
    m64 = nca_model()
    m32 = nca_model(torch.float32)
    idx = torch.tensor([[16, 0, 1, 17, 16, 2, 3, 18]])
    targets = torch.tensor([[0, 1, 17, 18, 2, 3, 16, 18]])
    assert m32(idx, targets)[1].item() == pytest.approx(m64(idx, targets)[1].item(), rel=1e-5)


@pytest.mark.parametrize(
    ("vocab", "head", "message"),
    [
        (18, {}, "model.vocab_size must be >= 19"),
        (19, {"eos_id": 19}, "model.language_head.eos_id must be < model.vocab_size (19)"),
        (19, {"eos_id": 3}, "model.language_head.eos_id must be >= the patch vocabulary 16"),
        (19, {"state_count": 1}, "model.language_head.state_count must be an integer >= 2"),
        (19, {"patch_size": 0}, "model.language_head.patch_size must be a positive integer"),
        (19, {"frame_special_tokens": 1}, "frame_special_tokens must be true or false"),
        (19, {"type": "patch"}, "model.language_head.type must be one of"),
    ],
)
def test_config_errors(vocab, head, message):
    cfg = BDHConfig(vocab_size=vocab, language_head=nca_head(**head))
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert message in str(err.value)


def test_nca_loss_function_without_special_head():
    head = nca_head(frame_special_tokens=False, eos_id=None)
    g = torch.Generator().manual_seed(3)
    hidden, w = torch.randn(5, 4, generator=g), torch.randn(4, 8, generator=g)
    targets = torch.tensor([3, 16, 0, IGNORE_INDEX, 15])  # 16 is no patch: 0, not counted
    total, counted = hand_loss(hidden, targets, w.tolist(), [], 2, 4, [])
    loss = nca_factorized_loss(hidden, targets, w, None, head)
    assert counted == 3 and loss.item() == pytest.approx(total / 3, rel=1e-5)


@pytest.mark.parametrize("head_type", ["token", "nca_factorized_patch"])
def test_mean_loss_is_sum_over_the_heads_own_count(head_type):
    """`count_targets` is the one counting rule: the head's mean is its sum over that count,
    whatever ids the targets hold (ignored ones, and for NCA ids that are neither patch nor
    special)."""
    model = nca_model() if head_type != "token" else tiny_model(torch.float64, vocab_size=20)
    head = model.config.language_head
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 7, 16, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 20, (2, 7), generator=g)
    targets[0, :2] = IGNORE_INDEX
    targets[1, 3] = 19
    mask = counted_target_mask(targets, head)
    unscored = int((targets == 19).sum()) if head_type != "token" else 0  # NCA: 19 is no id
    expected = 14 - 2 - unscored
    assert count_targets(targets, head) == mask.sum().item() == expected
    total = model.loss_from_hidden(hidden, targets, "sum")
    mean = model.loss_from_hidden(hidden, targets)
    assert mean.item() == pytest.approx(total.item() / expected, rel=1e-12)


def test_specials_without_their_head_are_refused():
    head = nca_head()
    hidden, w = torch.randn(3, 4), torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"special tokens \[16, 17, 18\] but no special_head"):
        nca_factorized_loss(hidden, torch.tensor([0, 16, 1]), w, None, head)
