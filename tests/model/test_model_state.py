"""Carried state: split calls equal one call; per-row positions and resets."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, tiny_model

from bdh_train.errors import CheckpointError


@pytest.mark.parametrize("position", ["rope", "alibi"])
@pytest.mark.parametrize("splits", [[3, 5, 8], [1] * 16, [16], [7, 9]])
@pytest.mark.parametrize("executor", ["auto", "chunked"])
def test_split_calls_equal_one_call(position, splits, executor):
    model = tiny_model(position=position, executor=executor)
    idx = torch.randint(0, 32, (2, 16))
    targets = torch.randint(0, 32, (2, 16))
    full_state = model.init_state(2)
    full_hidden = model.forward_hidden(idx, full_state)
    full_loss = model.loss_from_hidden(full_hidden, targets)

    state = model.init_state(2)
    pieces, start = [], 0
    for size in splits:
        pieces.append(model.forward_hidden(idx[:, start : start + size], state))
        start += size
    hidden = torch.cat(pieces, dim=1)
    assert_close(hidden, full_hidden, rtol=1e-5)
    assert abs(model.loss_from_hidden(hidden, targets) - full_loss) / full_loss < 1e-5
    for r, r_full in zip(state.rho, full_state.rho, strict=True):
        assert_close(r, r_full, rtol=1e-5)
    assert state.position.tolist() == [16, 16]


def test_rows_at_different_positions():
    """Row 0 continues a document at position 5 while row 1 starts fresh: each matches its own
    single-row computation."""
    model = tiny_model(position="rope")
    prefix = torch.randint(0, 32, (1, 5))
    chunk = torch.randint(0, 32, (2, 6))

    state = model.init_state(2)
    model.forward_hidden(torch.cat([prefix, prefix]), state)
    state.reset_(torch.tensor([False, True]))
    assert state.position.tolist() == [5, 0]
    both = model.forward_hidden(chunk, state)
    assert state.position.tolist() == [11, 6]

    solo = model.init_state(1)
    expected_row0 = model.forward_hidden(torch.cat([prefix, chunk[:1]], dim=1), solo)[:, 5:]
    expected_row1 = model.forward_hidden(chunk[1:])
    assert_close(both[:1], expected_row0, rtol=1e-5)
    assert_close(both[1:], expected_row1, rtol=1e-5)


def test_detach_cuts_graph_and_keeps_values():
    model = tiny_model()
    state = model.init_state(1)
    model.forward_hidden(torch.randint(0, 32, (1, 4)), state)
    assert state.rho[0].requires_grad
    before = [r.clone() for r in state.rho]
    state.detach_()
    assert not any(r.requires_grad for r in state.rho)
    assert all(torch.equal(a, b) for a, b in zip(before, state.rho, strict=True))


def test_state_dict_round_trip_and_errors():
    model = tiny_model()
    state = model.init_state(2)
    model.forward_hidden(torch.randint(0, 32, (2, 4)), state)
    restored = model.init_state(2).load_state_dict(state.state_dict())
    assert torch.equal(restored.position, state.position)
    assert all(torch.equal(a, b) for a, b in zip(restored.rho, state.rho, strict=True))

    target = model.init_state(2)
    with pytest.raises(CheckpointError, match="unexpected model state entry 'rho.9'"):
        target.load_state_dict(
            {"position": torch.zeros(2, dtype=torch.long), "rho.9": torch.zeros(2, 2, 32, 16)}
        )
    with pytest.raises(CheckpointError, match="no 'position'"):
        target.load_state_dict({})
    assert target.rho == [None, None]


def test_reset_mask_shape_is_checked():
    state = tiny_model().init_state(3)
    with pytest.raises(ValueError, match=r"reset mask must have shape \[3\]"):
        state.reset_(torch.tensor([True, False]))
