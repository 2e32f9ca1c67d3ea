"""Carried state: split calls equal one call; per-row positions and resets."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, tiny_model

from bdh_train.errors import CheckpointError
from bdh_train.model.state import SUMMARY_KEYS, ModelState, _checked_carry_entry
from bdh_train.model.summary import SummaryCarry


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


# ------------------------------------------------------------ ModelState on hand-made tensors


def _error(excinfo: pytest.ExceptionInfo) -> str:
    return str(excinfo.value)


def _carry(batch: int, width: int, base: float) -> SummaryCarry:
    """A summary carry with distinct, non-zero entries in every row."""
    memory = torch.arange(batch * width, dtype=torch.float64).view(batch, 1, 1, width) + base
    return SummaryCarry(memory, memory * 10 + 1, torch.arange(1, batch + 1) * 7)


def _filled_state(batch: int = 3) -> ModelState:
    """Layers 0 and 2 have rho and a summary carry, layer 1 has neither; layer 2 has the token
    shift's previous input."""
    state = ModelState(3, batch)
    state.rho[0] = torch.arange(batch * 2 * 3 * 4, dtype=torch.float64).view(batch, 2, 3, 4) + 1
    state.rho[2] = -torch.arange(batch * 8, dtype=torch.float32).view(batch, 1, 2, 4) - 1
    state.summary[0] = _carry(batch, 4, 1.0)
    state.summary[2] = _carry(batch, 2, 100.0)
    state.previous[2] = torch.arange(batch * 4, dtype=torch.float32).view(batch, 1, 1, 4) + 0.5
    state.position = torch.arange(batch) * 5 + 2
    return state


def _assert_states_equal(a: ModelState, b: ModelState) -> None:
    assert torch.equal(a.position, b.position) and a.position.dtype == b.position.dtype
    assert [r is None for r in a.rho] == [r is None for r in b.rho]
    for r, s in zip(a.rho, b.rho, strict=True):
        if r is not None:
            assert r.dtype == s.dtype and torch.equal(r, s)
    assert [p is None for p in a.previous] == [p is None for p in b.previous]
    for p, q in zip(a.previous, b.previous, strict=True):
        if p is not None:
            assert p.dtype == q.dtype and torch.equal(p, q)
    assert [c is None for c in a.summary] == [c is None for c in b.summary]
    for c, d in zip(a.summary, b.summary, strict=True):
        if c is not None:
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(c, d, strict=True))


def test_fresh_state_shapes():
    state = ModelState(3, 2, device="meta")
    assert state.rho == [None, None, None] and state.summary == [None, None, None]
    assert state.previous == [None, None, None]
    assert state.n_layer == 3 and state.batch_size == 2
    assert state.position.dtype == torch.long and state.position.shape == (2,)
    assert state.position.device.type == "meta"
    assert ModelState(1, 4).position.tolist() == [0, 0, 0, 0]


def test_detach_cuts_summary_and_keeps_none():
    state = _filled_state(2)
    weight = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    state.rho[0] = state.rho[0] * weight
    state.previous[2] = state.previous[2] * weight
    state.summary[0] = SummaryCarry(
        *(t * weight if t.is_floating_point() else t for t in state.summary[0])
    )
    expected = _filled_state(2)
    expected.rho[0] = expected.rho[0] * 2
    expected.previous[2] = (expected.previous[2] * 2).float()
    expected.summary[0] = SummaryCarry(
        expected.summary[0].memory * 2,
        expected.summary[0].chunk_sum * 2,
        expected.summary[0].chunk_hits,
    )
    assert state.detach_() is state
    assert not any(t.requires_grad for t in state.summary[0])
    assert not state.rho[0].requires_grad and not state.previous[2].requires_grad
    _assert_states_equal(state, expected)


def test_reset_zeroes_exactly_the_masked_rows():
    state = _filled_state(3)
    original = _filled_state(3)
    assert state.reset_(torch.tensor([0, 1, 0])) is state  # any dtype: read as a bool mask
    assert state.position.tolist() == [2, 0, 12]
    assert state.rho[1] is None and state.summary[1] is None
    assert state.previous[0] is None and state.previous[1] is None
    assert torch.equal(state.previous[2][1], torch.zeros(1, 1, 4))
    assert torch.equal(state.previous[2][[0, 2]], original.previous[2][[0, 2]])
    for layer in (0, 2):
        assert state.rho[layer].dtype == original.rho[layer].dtype
        assert torch.equal(state.rho[layer][1], torch.zeros_like(original.rho[layer][1]))
        assert torch.equal(state.rho[layer][[0, 2]], original.rho[layer][[0, 2]])
        for got, was in zip(state.summary[layer], original.summary[layer], strict=True):
            assert got.dtype == was.dtype and got.shape == was.shape
            assert torch.equal(got[1], torch.zeros_like(was[1]))
            assert torch.equal(got[[0, 2]], was[[0, 2]])

    state.reset_()
    assert state.position.tolist() == [0, 0, 0]
    assert not state.rho[0].any() and not state.rho[2].any()
    assert not any(t.any() for t in [*state.summary[0], *state.summary[2]])
    assert not state.previous[2].any()

    meta = ModelState(1, 2, device="meta")
    meta.rho[0] = torch.ones(2, 1, 1, 1, device="meta")
    meta.reset_(torch.tensor([True, False]))  # the mask follows the state to its device
    assert meta.position.device.type == "meta" and meta.rho[0].device.type == "meta"


def test_reset_mask_shape_message():
    with pytest.raises(ValueError) as excinfo:
        ModelState(1, 3).reset_(torch.tensor([True, False]))
    assert _error(excinfo) == "reset mask must have shape [3], got (2,)"


def test_to_moves_every_tensor():
    state = _filled_state(2)
    assert state.to("meta") is state
    tensors = [state.position, state.rho[0], state.rho[2], *state.summary[0], *state.summary[2]]
    assert all(t.device.type == "meta" for t in [*tensors, state.previous[2]])
    assert state.rho[1] is None and state.summary[1] is None and state.previous[0] is None


def test_clone_is_equal_and_independent():
    state = _filled_state(2)
    copy = state.clone()
    _assert_states_equal(copy, _filled_state(2))
    assert copy.n_layer == 3 and copy.batch_size == 2
    copy.rho[0].add_(1)
    copy.rho[2].add_(1)
    for t in copy.summary[0]:
        t.add_(1)
    copy.previous[2].add_(1)
    copy.position.add_(1)
    _assert_states_equal(state, _filled_state(2))
    meta = _filled_state(2).to("meta").clone()
    assert meta.position.device.type == "meta" and meta.rho[0].device.type == "meta"


def test_state_dict_keys_values_and_round_trip():
    state = _filled_state(2)
    weight = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    state.rho[0] = state.rho[0] * weight
    state.summary[0] = SummaryCarry(state.summary[0].memory * weight, *state.summary[0][1:])
    sd = state.state_dict()
    assert sorted(sd) == sorted(
        [
            "position",
            "rho.0",
            "rho.2",
            "summary_memory.0",
            "summary_chunk_sum.0",
            "summary_chunk_hits.0",
            "summary_memory.2",
            "summary_chunk_sum.2",
            "summary_chunk_hits.2",
            "previous.2",
        ]
    )
    assert not any(t.requires_grad for t in sd.values())
    assert torch.equal(sd["summary_chunk_hits.0"], torch.tensor([7, 14]))
    for t in sd.values():  # copies: writing into them leaves the state alone
        t.add_(1)
    state.detach_()
    _assert_states_equal(state, _filled_state(2))

    restored = ModelState(3, 2).load_state_dict(_filled_state(2).state_dict())
    _assert_states_equal(restored, _filled_state(2))
    sd = _filled_state(2).state_dict()
    restored = ModelState(3, 2).load_state_dict(sd)
    sd["position"].add_(1)  # the loaded position is a copy
    assert restored.position.tolist() == [2, 7]

    meta = ModelState(3, 2, device="meta").load_state_dict(_filled_state(2).state_dict())
    tensors = [meta.position, meta.rho[0], meta.rho[2], *meta.summary[0], *meta.summary[2]]
    assert all(t.device.type == "meta" for t in tensors)


def test_load_without_summary_starts_it_fresh():
    state = _filled_state(2)
    state.summary[0] = state.summary[2] = None
    restored = _filled_state(2).load_state_dict(state.state_dict())
    assert restored.summary == [None, None, None]
    assert restored.rho[1] is None


def _position(batch: int = 2) -> dict[str, torch.Tensor]:
    return {"position": torch.zeros(batch, dtype=torch.long)}


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({}, "model state checkpoint has no 'position' entry"),
        (
            {"position": torch.zeros(2, 1, dtype=torch.long)},
            "model state 'position' must be a 1-D long tensor, got (2, 1) torch.int64",
        ),
        (
            {"position": torch.zeros(2, dtype=torch.int32)},
            "model state 'position' must be a 1-D long tensor, got (2,) torch.int32",
        ),
        (
            {**_position(), "rho.3": torch.zeros(2, 1, 1, 1)},
            "unexpected model state entry 'rho.3' for a 3-layer model",
        ),
        (
            {**_position(), "rho.x": torch.zeros(2, 1, 1, 1)},
            "unexpected model state entry 'rho.x' for a 3-layer model",
        ),
        (
            {**_position(), "rho": torch.zeros(2, 1, 1, 1)},
            "unexpected model state entry 'rho' for a 3-layer model",
        ),
        (
            {**_position(), "summary_other.0": torch.zeros(2, 1, 1, 1)},
            "unexpected model state entry 'summary_other.0' for a 3-layer model",
        ),
        (
            {**_position(), "summary_memory.3": torch.zeros(2, 1, 1, 4)},
            "unexpected model state entry 'summary_memory.3' for a 3-layer model",
        ),
        (
            {**_position(), "rho.0": torch.zeros(2, 1, 1)},
            "model state 'rho.0' must be [B, H, N, D] with B=2, got (2, 1, 1)",
        ),
        (
            {**_position(), "rho.2": torch.zeros(3, 1, 1, 1)},
            "model state 'rho.2' must be [B, H, N, D] with B=2, got (3, 1, 1, 1)",
        ),
        (
            {**_position(), "previous.3": torch.zeros(2, 1, 1, 4)},
            "unexpected model state entry 'previous.3' for a 3-layer model",
        ),
        (
            {**_position(), "previous.0": torch.zeros(2, 1, 2, 4)},
            "model state 'previous.0' must be [2, 1, 1, D], got (2, 1, 2, 4) torch.float32",
        ),
        (
            {**_position(), "previous.1": torch.zeros(3, 1, 1, 4)},
            "model state 'previous.1' must be [2, 1, 1, D], got (3, 1, 1, 4) torch.float32",
        ),
        (
            {**_position(), "summary_chunk_hits.1": torch.zeros(2, dtype=torch.int32)},
            "model state 'summary_chunk_hits.1' must be [2] long, got (2,) torch.int32",
        ),
        (
            {**_position(), "summary_chunk_hits.1": torch.zeros(3, dtype=torch.long)},
            "model state 'summary_chunk_hits.1' must be [2] long, got (3,) torch.int64",
        ),
        (
            {**_position(), "summary_memory.0": torch.zeros(2, 1, 4)},
            "model state 'summary_memory.0' must be [2, 1, 1, D], got (2, 1, 4) torch.float32",
        ),
        (
            {**_position(), "summary_chunk_sum.0": torch.zeros(2, 1, 2, 4)},
            "model state 'summary_chunk_sum.0' must be [2, 1, 1, D], "
            "got (2, 1, 2, 4) torch.float32",
        ),
        (
            {**_position(), "summary_memory.0": torch.zeros(3, 1, 1, 4)},
            "model state 'summary_memory.0' must be [2, 1, 1, D], got (3, 1, 1, 4) torch.float32",
        ),
        (
            {**_position(), "summary_memory.2": torch.zeros(2, 1, 1, 4)},
            "model state layer 2 has a partial summary memory: missing summary_chunk_hits.2, "
            "summary_chunk_sum.2",
        ),
        (
            {
                **_position(),
                "summary_chunk_hits.1": torch.zeros(2, dtype=torch.long),
                "summary_chunk_sum.1": torch.zeros(2, 1, 1, 4),
            },
            "model state layer 1 has a partial summary memory: missing summary_memory.1",
        ),
    ],
)
def test_load_state_dict_refusals_change_nothing(entries, message):
    state = _filled_state(2)
    with pytest.raises(CheckpointError) as excinfo:
        state.load_state_dict(entries)
    assert _error(excinfo) == message
    _assert_states_equal(state, _filled_state(2))


def test_checked_carry_entry_accepts_its_shapes():
    hits = torch.tensor([1, 2], dtype=torch.long)
    assert _checked_carry_entry("k", "chunk_hits", hits, 2) is hits
    memory = torch.zeros(2, 1, 1, 5)
    assert _checked_carry_entry("k", "memory", memory, 2) is memory
    assert _checked_carry_entry("k", "chunk_sum", memory, 2) is memory
    assert SUMMARY_KEYS == {
        "memory": "summary_memory",
        "chunk_sum": "summary_chunk_sum",
        "chunk_hits": "summary_chunk_hits",
    }
