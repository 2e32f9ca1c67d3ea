"""Token-weighted all-reduce of accumulated gradients: ranks with unequal (even zero) token
counts must give exactly the single-process gradient of the global mean loss."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_close, run_multiprocess
from torch import nn

from bdh_train.train.accumulate import (
    AccumulatedGradients,
    EmptyWeightError,
    GradientError,
    InvalidWeightError,
    WeightedAccumulationState,
    WeightedGradientAccumulator,
    normalize_gradients,
)
from bdh_train.train.reduce import (
    all_reduce_accumulated,
)
from bdh_train.utils import in_process_group

WORLD = 2
SPAWN_TIMEOUT_S = 50.0
EMPTY_MSG = "cannot normalize an accumulation window with zero effective weight"

# case -> (loss scale, per-rank microbatch sizes, per-rank loss reduction)
CASES: dict[str, tuple[float, list[list[int]], list[str]]] = {
    "unequal": (1.0, [[5, 2, 7], [3]], ["sum", "mean"]),
    "rank1_empty": (1024.0, [[4, 6, 1], [0]], ["mean", "sum"]),
    "global_empty": (1.0, [[0], [0, 0]], ["sum", "mean"]),
}


class TinyMLP(nn.Module):
    """Seeded 2-layer MLP; `unused` is produced by no rank and must stay absent."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1234)
        self.fc1 = nn.Linear(4, 6, dtype=torch.float64)
        self.fc2 = nn.Linear(6, 3, dtype=torch.float64)
        self.unused = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def global_batch(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of a case: rank 0's microbatches first, then rank 1's."""
    _, sizes, _ = CASES[case]
    n = sum(sum(rank) for rank in sizes)
    gen = torch.Generator().manual_seed(len(case) * 7919 + n)
    return torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=gen
    )


def rank_microbatches(case: str, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, sizes, _ = CASES[case]
    x, y = global_batch(case)
    start = sum(sum(r) for r in sizes[:rank])
    out = []
    for size in sizes[rank]:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def local_sums(case: str, rank: int, model: nn.Module, scale: float) -> AccumulatedGradients:
    """What one rank does: accumulate its microbatches through `.grad`, then finish_sums."""
    _, _, reductions = CASES[case]
    acc = WeightedGradientAccumulator(model, dtype=torch.float64, loss_scale=scale)
    for x, y in rank_microbatches(case, rank):
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y, reduction=reductions[rank])
        (loss * scale).backward()
        if reductions[rank] == "sum":
            acc.accumulate_sum(weight=len(y))
        else:
            acc.accumulate_mean(weight=len(y))
    return acc.finish_sums()


def reference(case: str) -> dict[str, torch.Tensor]:
    model = TinyMLP()
    x, y = global_batch(case)
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    grads = torch.autograd.grad(
        F.cross_entropy(model(x), y), [model.get_parameter(n) for n in names]
    )
    return dict(zip(names, grads, strict=True))


def _worker(rank: int, world: int) -> dict[str, Any]:
    """One rank: run every case in one process group, return the outcomes to the parent."""
    outcome: dict[str, Any] = {}
    for case, (loss_scale, _, _) in CASES.items():
        result = local_sums(case, rank, TinyMLP(), loss_scale)
        try:
            outcome[case] = all_reduce_accumulated(result, TinyMLP())
        except EmptyWeightError as exc:
            outcome[case] = f"{type(exc).__name__}: {exc}"
    # Ranks that disagree on the loss scale are told so, on every rank.
    skewed = AccumulatedGradients({}, WeightedAccumulationState(torch.float64, 1.0 + rank))
    try:
        all_reduce_accumulated(skewed, TinyMLP())
        outcome["skewed"] = "not detected"
    except GradientError as exc:
        outcome["skewed"] = f"{type(exc).__name__}: {exc}"
    return outcome


@pytest.fixture(scope="module")
def ddp_outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """WORLD gloo ranks, spawned once for all cases."""
    tmp = tmp_path_factory.mktemp("ddp")
    return run_multiprocess(_worker, tmp, world=WORLD, timeout=SPAWN_TIMEOUT_S)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["unequal", "rank1_empty"])
def test_ddp_equals_single_process_gradient(ddp_outcomes: list[dict], case: str) -> None:
    expected = reference(case)
    for rank, outcome in enumerate(ddp_outcomes):
        got = outcome[case]
        assert isinstance(got, dict), f"rank {rank}: {got}"
        assert "unused" not in got, "a parameter no rank produced must stay absent"
        assert_close(got, expected, rtol=1e-12, msg=f"{case} rank {rank}")
    for name in expected:
        assert torch.equal(ddp_outcomes[0][case][name], ddp_outcomes[1][case][name])


@pytest.mark.multiprocess
def test_ddp_zero_global_weight_raises_on_every_rank(ddp_outcomes: list[dict]) -> None:
    for outcome in ddp_outcomes:
        assert outcome["global_empty"] == f"EmptyWeightError: {EMPTY_MSG}"


@pytest.mark.multiprocess
def test_ddp_loss_scale_mismatch_is_detected_on_every_rank(ddp_outcomes: list[dict]) -> None:
    for outcome in ddp_outcomes:
        assert outcome["skewed"].startswith("GradientError: ranks disagree")


def test_without_process_group_it_is_the_single_process_finish() -> None:
    assert not in_process_group()
    model = TinyMLP()
    sums = [local_sums("unequal", rank, model, 8.0) for rank in range(WORLD)]
    acc = WeightedGradientAccumulator(model, dtype=torch.float64, loss_scale=8.0)
    for rank_sums in sums:
        acc.accumulate_sum(rank_sums.gradients, weight=rank_sums.state.total_weight)
    merged = acc.finish_sums()
    out = all_reduce_accumulated(merged, model)
    assert_close(out, reference("unequal"), rtol=1e-12, msg="no process group")
    empty = AccumulatedGradients({}, WeightedAccumulationState(torch.float64, 1.0, 0.0, 3))
    with pytest.raises(EmptyWeightError) as info:
        all_reduce_accumulated(empty, model)
    assert str(info.value) == EMPTY_MSG


@pytest.mark.parametrize(
    ("grads", "message"),
    [
        ({"nope": torch.zeros(1, dtype=torch.float64)}, "'nope'"),
        ({"fc1.bias": torch.zeros(5, dtype=torch.float64)}, "'fc1.bias' has shape"),
        ({"fc1.bias": torch.zeros(6, dtype=torch.float32)}, "'fc1.bias' is torch.float32"),
    ],
)
def test_foreign_gradients_are_rejected(grads: dict, message: str) -> None:
    state = WeightedAccumulationState(torch.float64, 1.0, 1.0, 1)
    with pytest.raises(GradientError, match=message):
        all_reduce_accumulated(AccumulatedGradients(grads, state), TinyMLP())


# ------------------------------------------------------------------ work-dtype mismatch
DTYPE_SKEW_SCALE = 4.0


def _dtype_skew_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 accumulates in float32, rank 1 in float64, both with the same loss scale."""
    outcome: dict[str, Any] = {}
    model = TinyMLP()
    work_dtype = torch.float32 if rank == 0 else torch.float64
    acc = WeightedGradientAccumulator(model, dtype=work_dtype, loss_scale=DTYPE_SKEW_SCALE)
    x, y = rank_microbatches("unequal", rank)[0]
    (F.cross_entropy(model(x), y) * DTYPE_SKEW_SCALE).backward()
    acc.accumulate_mean(weight=len(y))
    result = acc.finish_sums()
    outcome["dtype"] = result.state.dtype
    try:
        all_reduce_accumulated(result, model)
        outcome["dtype_skewed"] = "not detected"
    except GradientError as exc:
        outcome["dtype_skewed"] = f"{type(exc).__name__}: {exc}"
    # The refusal leaves the group usable: the same reduction in one dtype goes through.
    agreeing = WeightedGradientAccumulator(model, dtype=torch.float64, loss_scale=1.0)
    agreeing.accumulate_sum(weight=1.0)
    all_reduce_accumulated(agreeing.finish_sums(), model)
    outcome["agreeing_after"] = "passed"
    return outcome


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_ddp_work_dtype_mismatch_is_refused_on_every_rank(tmp_path: Path) -> None:
    outcomes = run_multiprocess(_dtype_skew_worker, tmp_path, world=WORLD, timeout=50.0)
    assert [o.get("dtype") for o in outcomes] == [torch.float32, torch.float64]
    for rank, outcome in enumerate(outcomes):
        message = outcome["dtype_skewed"]
        # float32 and float64 are coded 32 and 64; the loss scales agree at 4.0.
        assert message == (
            "GradientError: ranks disagree on the accumulation window: loss scale in "
            "[4.0, 4.0], dtype code in [32.0, 64.0]"
        ), f"rank {rank}: {message}"
        assert outcome["agreeing_after"] == "passed", f"rank {rank}"


# ------------------------------------------------ the bucket path in a one-rank process group
def _merged_sums(model: nn.Module, dtype: torch.dtype, scale: float) -> AccumulatedGradients:
    """Both ranks' microbatches of the "unequal" case accumulated on one rank."""
    acc = WeightedGradientAccumulator(model, dtype=dtype, loss_scale=scale)
    for rank in range(WORLD):
        rank_sums = local_sums("unequal", rank, model, scale)
        grads = {name: g.to(dtype) for name, g in rank_sums.gradients.items()}
        acc.accumulate_sum(grads, weight=rank_sums.state.total_weight)
    return acc.finish_sums()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_rank_bucket_is_bit_identical_to_the_single_process_finish(single_process_group, dtype):
    """Packing into the flat bucket, the identity SUM and unpacking change no bit: the result is
    the no-group path's, in the work dtype; `unused` (no gradient) stays absent."""
    model = TinyMLP()
    merged = _merged_sums(model, dtype, 8.0)
    want = normalize_gradients(merged.gradients, 8.0, merged.state.total_weight)
    got = all_reduce_accumulated(merged, model)
    assert list(got) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    for name, grad in got.items():
        assert grad.dtype == dtype and grad.shape == model.get_parameter(name).shape, name
        assert torch.equal(grad, want[name]), name
    if dtype == torch.float64:
        assert_close(got, reference("unequal"), rtol=1e-12, msg="one-rank group")


def test_one_rank_zero_gradient_stays_present(single_process_group):
    """The presence mask, not the values, decides which gradients come back: an all-zero
    gradient is returned (as zeros), a missing one is not."""
    model = TinyMLP()
    state = WeightedAccumulationState(torch.float64, 2.0, 4.0, 1)
    grads = {
        "unused": torch.zeros(2, dtype=torch.float64),
        "fc2.bias": torch.tensor([8.0, -4.0, 2.0], dtype=torch.float64),
    }
    got = all_reduce_accumulated(AccumulatedGradients(grads, state), model)
    assert {name: g.tolist() for name, g in got.items()} == {
        "fc2.bias": [1.0, -0.5, 0.25],
        "unused": [0.0, 0.0],
    }


@pytest.mark.parametrize(
    ("total_weight", "error", "detail"),
    [
        (0.0, EmptyWeightError, "global weight over all ranks is 0.0"),
        (float("inf"), InvalidWeightError, "global weight inf in torch.float64"),
        (float("nan"), InvalidWeightError, "global weight nan in torch.float64"),
    ],
)
def test_one_rank_global_weight_is_checked(single_process_group, total_weight, error, detail):
    state = WeightedAccumulationState(torch.float64, 1.0, total_weight, 1)
    grads = {"fc2.bias": torch.ones(3, dtype=torch.float64)}
    with pytest.raises(error) as info:
        all_reduce_accumulated(AccumulatedGradients(grads, state), TinyMLP())
    assert (str(info.value), info.value.detail) == (error.message, detail)


def test_one_rank_agrees_with_itself_on_the_window_settings(single_process_group):
    """The MAX probe of one rank: equal extremes, so no GradientError, whatever the scale."""
    for dtype, scale in ((torch.float64, 3.0), (torch.float32, 0.5)):
        state = WeightedAccumulationState(dtype, scale, 2.0, 1)
        grads = {"fc2.bias": torch.full((3,), 6.0, dtype=dtype)}
        got = all_reduce_accumulated(AccumulatedGradients(grads, state), TinyMLP())
        assert got["fc2.bias"].tolist() == [6.0 / scale / 2.0] * 3


# ------------------------------------------- a second rank emulated in the one-rank group
class EmulatedPeer:
    """Stands in for `dist.all_reduce` with one more rank: `record` keeps a copy of what this
    rank sends (and reduces over itself only); `replay` combines each call with the recorded
    tensor of the same call, by the op asked for (SUM or MAX), as the second rank would."""

    def __init__(self, sent: list[torch.Tensor] | None = None) -> None:
        self.sent = [] if sent is None else list(sent)
        self.replaying = sent is not None
        self.groups: list[Any] = []

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.groups.append(group)
        if not self.replaying:
            self.sent.append(tensor.clone())
            return
        peer = self.sent.pop(0).to(tensor.dtype)
        if op == dist.ReduceOp.MAX:
            torch.maximum(tensor, peer, out=tensor)
        else:
            assert op == dist.ReduceOp.SUM, op
            tensor.add_(peer)


def _as_two_ranks(
    monkeypatch, rank1: AccumulatedGradients, rank0: AccumulatedGradients, group=None
):
    """rank 0's result when rank 1 sends what it sends with `rank1`."""
    recorder = EmulatedPeer()
    monkeypatch.setattr(dist, "all_reduce", recorder)
    with pytest.raises(EmptyWeightError) if rank1.state.total_weight == 0 else nullcontext():
        all_reduce_accumulated(rank1, TinyMLP(), group)  # an empty rank alone: no weight
    replay = EmulatedPeer(recorder.sent)
    monkeypatch.setattr(dist, "all_reduce", replay)
    try:
        return all_reduce_accumulated(rank0, TinyMLP(), group)
    finally:
        assert replay.groups == recorder.groups == [group, group]


@pytest.mark.parametrize("case", ["unequal", "rank1_empty"])
def test_two_emulated_ranks_give_the_single_process_gradient(
    single_process_group, monkeypatch, case
):
    scale = CASES[case][0]
    rank0, rank1 = (local_sums(case, rank, TinyMLP(), scale) for rank in range(WORLD))
    group = dist.new_group([0])
    out = _as_two_ranks(monkeypatch, rank1, rank0, group)
    assert list(out) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert_close(out, reference(case), rtol=1e-12, msg=case)


def test_two_emulated_empty_ranks_refuse_together(single_process_group, monkeypatch):
    rank0, rank1 = (local_sums("global_empty", rank, TinyMLP(), 1.0) for rank in range(WORLD))
    with pytest.raises(EmptyWeightError) as info:
        _as_two_ranks(monkeypatch, rank1, rank0)
    assert info.value.detail == "global weight over all ranks is 0.0"


@pytest.mark.parametrize(
    ("peer", "message"),
    [
        ((torch.float64, 4.0), "loss scale in [4.0, 4.0], dtype code in [32.0, 64.0]"),
        # a difference float32 cannot hold: the probe is float64
        (
            (torch.float32, 4.0 + 2**-40),
            f"loss scale in [4.0, {4.0 + 2**-40!r}], dtype code in [32.0, 32.0]",
        ),
    ],
)
def test_an_emulated_rank_with_other_window_settings_is_refused(
    single_process_group, monkeypatch, peer, message
):
    mine = AccumulatedGradients({}, WeightedAccumulationState(torch.float32, 4.0, 1.0, 1))
    theirs = AccumulatedGradients({}, WeightedAccumulationState(*peer, 1.0, 1))
    recorder = EmulatedPeer()
    monkeypatch.setattr(dist, "all_reduce", recorder)
    all_reduce_accumulated(theirs, TinyMLP())
    monkeypatch.setattr(dist, "all_reduce", EmulatedPeer(recorder.sent))
    with pytest.raises(GradientError) as info:
        all_reduce_accumulated(mine, TinyMLP())
    assert str(info.value) == f"ranks disagree on the accumulation window: {message}"


def test_one_rank_float64_weight_keeps_every_bit(single_process_group):
    """A float64 window's weight travels in float64: 2**24 + 1 tokens (not a float32 value)
    divide exactly as in the single-process finish."""
    weight = float(2**24 + 1)
    state = WeightedAccumulationState(torch.float64, 1.0, weight, 1)
    grads = {"fc2.bias": torch.full((3,), 3.0, dtype=torch.float64)}
    got = all_reduce_accumulated(AccumulatedGradients(grads, state), TinyMLP())
    assert got["fc2.bias"].tolist() == [3.0 / weight] * 3
    assert 3.0 / weight != 3.0 / float(torch.tensor(weight, dtype=torch.float32))
