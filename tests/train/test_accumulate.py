"""WeightedGradientAccumulator: exactness over unequal microbatches, every validation rule of
the reference (type, message, and no mutation on rejection), and mid-window checkpoints."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bdh_train.errors import BDHTrainError
from bdh_train.train.accumulate import (
    U64_MAX,
    AccumulatedGradients,
    CounterOverflowError,
    EmptyWeightError,
    GradientError,
    InvalidStateError,
    InvalidWeightError,
    WeightedAccumulationError,
    WeightedAccumulationState,
    WeightedGradientAccumulator,
    write_to_params,
)

WEIGHT_MSG = "effective accumulation weight must be finite, nonnegative and representable"
COUNTER_MSG = "accumulation microbatch counter overflow"
EMPTY_MSG = "cannot normalize an accumulation window with zero effective weight"
STATE_MSG = "inconsistent weighted accumulation checkpoint state"
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}
F64_STATE = {"dtype": "float64", "loss_scale": 2.0, "total_weight": 3.0, "microbatches": 1}
DTYPE_DETAIL = (
    "weighted accumulation dtype must be 'float32' or 'float64' ('F32' or 'F64' as the Rust "
    "accumulator writes them), got "
)

IN, HIDDEN, CLASSES = 4, 8, 3


# ------------------------------------------------------------------------------------ helpers


class MLP(nn.Module):
    """Two layers and a cross-entropy over a few classes; `unused` never gets a gradient."""

    def __init__(self, dtype: torch.dtype, seed: int = 0, with_unused: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(IN, HIDDEN, dtype=dtype)
        self.fc2 = nn.Linear(HIDDEN, CLASSES, dtype=dtype)
        if with_unused:
            self.unused = nn.Parameter(torch.zeros(2, dtype=dtype))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_data(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randint(0, CLASSES, (n,), generator=gen)
    return x, y


def split(n_sizes: Sequence[int], x: torch.Tensor, y: torch.Tensor) -> list[tuple[Any, Any]]:
    out, start = [], 0
    for size in n_sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def grads_of(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    values = torch.autograd.grad(loss, params, allow_unused=True)
    return {n: g for n, g in zip(names, values, strict=True) if g is not None}


def reference_mean_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    return grads_of(model, F.cross_entropy(model(x), y))


def run_window(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    mode: str,
    dtype: torch.dtype,
    loss_scale: float = 1.0,
) -> AccumulatedGradients:
    """Accumulate through `.grad` (grads=None), as a training loop would."""
    acc = WeightedGradientAccumulator(model, dtype=dtype, loss_scale=loss_scale)
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        reduction = "sum" if mode == "sum" else "mean"
        (F.cross_entropy(model(x), y, reduction=reduction) * loss_scale).backward()
        if mode == "sum":
            acc.accumulate_sum(weight=len(y))
        else:
            acc.accumulate_mean(weight=len(y))
    return acc.finish_mean()


def assert_unchanged(acc: WeightedGradientAccumulator, before: dict[str, Any]) -> None:
    after = acc.state_dict()
    assert after["state"] == before["state"]
    assert after["gradients"].keys() == before["gradients"].keys()
    for name, value in before["gradients"].items():
        assert torch.equal(after["gradients"][name], value), name


def expect_rejected(
    acc: WeightedGradientAccumulator,
    call: Callable[[], object],
    error: type[Exception],
    message: str,
    exact: bool = True,
) -> Exception:
    """Assert `call` raises `error` with `message` (exactly or as a substring) and no effect."""
    before = acc.state_dict()
    with pytest.raises(error) as info:
        call()
    if exact:
        assert str(info.value) == message
    else:
        assert message in str(info.value) or message in (info.value.detail or "")
    assert_unchanged(acc, before)
    return info.value


def primed(dtype: torch.dtype = torch.float64, **kwargs: Any) -> tuple[MLP, Any]:
    """An accumulator with one real microbatch pending, so 'unchanged' is meaningful."""
    model = MLP(dtype, **kwargs)
    acc = WeightedGradientAccumulator(model, dtype=dtype)
    x, y = make_data(3, dtype, 1)
    acc.accumulate_sum(grads_of(model, F.cross_entropy(model(x), y, reduction="sum")), weight=3)
    return model, acc


# ------------------------------------------------------------------------ exactness properties

sizes_strategy = st.lists(st.integers(0, 7), min_size=1, max_size=5).filter(lambda s: sum(s) > 0)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@settings(max_examples=25, deadline=None)
@given(sizes=sizes_strategy, seed=st.integers(0, 2**31 - 1))
def test_window_equals_mean_over_concatenated_batch(
    mode: str, dtype: torch.dtype, sizes: list[int], seed: int
) -> None:
    model = MLP(dtype, seed=seed % 1000)
    x, y = make_data(sum(sizes), dtype, seed)
    expected = reference_mean_grad(model, x, y)
    rtol = TOLERANCE[dtype]
    batches = split(sizes, x, y)

    result = run_window(model, batches, mode, dtype)
    assert result.state.total_weight == sum(sizes)
    assert result.state.microbatches == len(sizes)
    assert all(g.dtype == dtype for g in result.gradients.values())
    assert_close(result.gradients, expected, rtol=rtol, msg=f"{mode} {sizes}")

    scaled = run_window(model, batches, mode, dtype, loss_scale=1024.0)
    assert scaled.state.loss_scale == 1024.0
    assert_close(scaled.gradients, expected, rtol=rtol, msg=f"{mode} x1024 {sizes}")


def test_float32_work_dtype_for_float64_gradients_and_low_precision_params() -> None:
    """Gradients are converted to the work dtype; bf16 model gradients accumulate in float32."""
    model = MLP(torch.float64)
    x, y = make_data(9, torch.float64, 3)
    expected = reference_mean_grad(model, x, y)
    acc = WeightedGradientAccumulator(model, dtype=torch.float32)
    for bx, by in split([4, 0, 5], x, y):
        acc.accumulate_mean(grads_of(model, F.cross_entropy(model(bx), by)), weight=len(by))
    result = acc.finish_mean()
    assert all(g.dtype == torch.float32 for g in result.gradients.values())
    assert_close(result.gradients, expected, rtol=1e-6, msg="f64 grads in f32 work dtype")


def test_averaging_microbatch_means_is_wrong_for_unequal_sizes() -> None:
    """The bug this fixes: mean of per-microbatch means weights a 1-item batch like a 9-item."""
    model = MLP(torch.float64, seed=5)
    x, y = make_data(10, torch.float64, 7)
    expected = reference_mean_grad(model, x, y)
    batches = split([9, 1], x, y)
    naive: dict[str, torch.Tensor] = {}
    for bx, by in batches:
        for name, g in grads_of(model, F.cross_entropy(model(bx), by)).items():
            naive[name] = naive.get(name, 0) + g / len(batches)
    worst = max(((naive[n] - e).norm() / e.norm()).item() for n, e in expected.items())
    assert worst > 1e-3, "naive averaging should differ visibly from the exact mean"
    ours = run_window(model, batches, "mean", torch.float64)
    assert_close(ours.gradients, expected, rtol=1e-12, msg="weighted accumulation")


# ------------------------------------------------------------------------ window behaviour


def test_zero_weight_counts_but_contributes_nothing_even_with_nan_gradients() -> None:
    model, acc = primed()
    before = acc.state_dict()
    nan = {n: torch.full_like(p, math.nan) for n, p in model.named_parameters()}
    acc.accumulate_mean(nan, weight=0)
    acc.accumulate_sum({}, weight=0.0)
    assert acc.state.microbatches == 3
    assert acc.state.total_weight == 3.0
    after = acc.state_dict()
    for name, value in before["gradients"].items():
        assert torch.equal(after["gradients"][name], value)


def test_finish_sums_returns_scaled_sums_and_resets() -> None:
    model = MLP(torch.float64)
    acc = WeightedGradientAccumulator(model, dtype=torch.float64, loss_scale=8.0)
    g = {"fc1.bias": torch.ones(HIDDEN, dtype=torch.float64)}
    acc.accumulate_sum(g, weight=2)
    acc.accumulate_mean(g, weight=3)
    result = acc.finish_sums()
    assert result.state == WeightedAccumulationState(torch.float64, 8.0, 5.0, 2)
    assert list(result.gradients) == ["fc1.bias"]
    assert torch.equal(
        result.gradients["fc1.bias"], torch.full((HIDDEN,), 4.0, dtype=torch.float64)
    )
    assert acc.state == WeightedAccumulationState(torch.float64, 8.0, 0.0, 0)
    assert acc.state_dict()["gradients"] == {}
    g["fc1.bias"].add_(100)  # the accumulator copied the caller's tensor
    assert torch.equal(
        result.gradients["fc1.bias"], torch.full((HIDDEN,), 4.0, dtype=torch.float64)
    )


def test_finish_mean_divides_sequentially_not_by_the_product() -> None:
    """loss_scale * total_weight overflows float32; the two divisions do not."""
    model = MLP(torch.float32)
    acc = WeightedGradientAccumulator(model, dtype=torch.float32, loss_scale=1e30)
    acc.accumulate_sum({"fc2.bias": torch.full((CLASSES,), 2e38)}, weight=1e20)
    result = acc.finish_mean()
    expected = torch.tensor(2e38, dtype=torch.float32) / torch.tensor(1e30) / torch.tensor(1e20)
    assert torch.isfinite(result.gradients["fc2.bias"]).all()
    assert torch.equal(result.gradients["fc2.bias"], expected.expand(CLASSES))


def test_unused_parameters_stay_absent_and_write_to_params_sets_none() -> None:
    model = MLP(torch.float32, with_unused=True)
    x, y = make_data(4, torch.float32, 0)
    result = run_window(model, [(x, y)], "mean", torch.float32)
    assert "unused" not in result.gradients
    model.unused.grad = torch.ones(2)
    result.write_to(model)
    assert model.unused.grad is None
    assert torch.equal(model.fc1.weight.grad, result.gradients["fc1.weight"])
    assert model.fc1.weight.grad is not result.gradients["fc1.weight"]
    # a copy, also when dtype and device already match: the result's storage is not shared
    assert model.fc1.weight.grad.data_ptr() != result.gradients["fc1.weight"].data_ptr()
    half = MLP(torch.float32).to(torch.bfloat16)
    write_to_params(result.gradients, half)
    assert half.fc1.weight.grad.dtype == torch.bfloat16
    with pytest.raises(GradientError, match="'nope'"):
        write_to_params({"nope": torch.zeros(1)}, half)


def test_accepts_named_parameter_iterables_and_mappings() -> None:
    model = MLP(torch.float64)
    for source in (model.named_parameters(), dict(model.named_parameters())):
        acc = WeightedGradientAccumulator(source, dtype=torch.float64)
        acc.accumulate_sum({"fc1.bias": torch.ones(HIDDEN, dtype=torch.float64)}, weight=1)
        assert acc.pending_names == ["fc1.bias"]


# ------------------------------------------------------------------------ validation rules


def test_error_hierarchy() -> None:
    for cls in (InvalidWeightError, CounterOverflowError, EmptyWeightError, InvalidStateError):
        assert issubclass(cls, WeightedAccumulationError)
    assert issubclass(GradientError, WeightedAccumulationError)
    assert issubclass(WeightedAccumulationError, BDHTrainError)
    assert str(InvalidStateError("why")) == STATE_MSG
    assert InvalidStateError("why").detail == "why"
    assert InvalidStateError().detail is None
    assert (str(GradientError("what")), GradientError("what").detail) == ("what", None)


@pytest.mark.parametrize(
    ("dtype", "weight"),
    [
        (torch.float64, -1.0),
        (torch.float64, -0.5e-300),
        (torch.float64, math.nan),
        (torch.float64, math.inf),
        (torch.float32, -math.inf),
        (torch.float32, 1e300),  # finite in float64, overflows float32
        (torch.float32, 1e-300),  # non-zero in float64, flushes to zero in float32
        (torch.float64, True),
        (torch.float64, "3"),
    ],
)
def test_invalid_weight_is_rejected_without_mutation(dtype: torch.dtype, weight: Any) -> None:
    model, acc = primed(dtype)
    good = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    for method in (acc.accumulate_sum, acc.accumulate_mean):
        err = expect_rejected(
            acc, lambda m=method: m(good, weight=weight), InvalidWeightError, WEIGHT_MSG
        )
        assert err.detail == f"weight {weight!r} in {str(dtype).removeprefix('torch.')}"


def test_weights_unrepresentable_in_float32_are_fine_in_float64() -> None:
    model, acc = primed(torch.float64)
    acc.accumulate_sum({}, weight=1e300)
    acc.accumulate_sum({}, weight=1e-300)
    assert acc.state.microbatches == 3


def test_total_weight_overflow_is_rejected_without_mutation() -> None:
    model, acc = primed(torch.float32)
    acc.accumulate_sum({}, weight=3e38)
    err = expect_rejected(
        acc, lambda: acc.accumulate_sum({}, weight=1e38), InvalidWeightError, WEIGHT_MSG
    )
    assert err.detail == f"new total weight {3.0 + 3e38 + 1e38!r} in float32"
    model64, acc64 = primed(torch.float64)
    acc64.accumulate_sum({}, weight=1.7e308)
    err = expect_rejected(
        acc64, lambda: acc64.accumulate_mean({}, weight=1.7e308), InvalidWeightError, WEIGHT_MSG
    )
    assert err.detail == "new total weight inf in float64"


def test_counter_overflow_is_rejected_without_mutation() -> None:
    model = MLP(torch.float64)
    acc = WeightedGradientAccumulator(model, dtype=torch.float64)
    state = WeightedAccumulationState(torch.float64, 1.0, 0.0, U64_MAX).to_dict()
    acc.load_state_dict({"gradients": {}, "state": state})
    good = {"fc1.bias": torch.ones(HIDDEN, dtype=torch.float64)}
    expect_rejected(
        acc, lambda: acc.accumulate_sum(good, weight=1), CounterOverflowError, COUNTER_MSG
    )
    expect_rejected(acc, lambda: acc.accumulate_mean(weight=0), CounterOverflowError, COUNTER_MSG)
    # Order: the weight is checked before the counter, the counter before the gradients.
    expect_rejected(
        acc, lambda: acc.accumulate_sum(good, weight=-1), InvalidWeightError, WEIGHT_MSG
    )
    bad = {"nope": torch.ones(1)}
    expect_rejected(
        acc, lambda: acc.accumulate_sum(bad, weight=1), CounterOverflowError, COUNTER_MSG
    )


def _bad_gradients(model: nn.Module) -> list[tuple[str, dict[str, Any], str]]:
    w = model.fc1.weight
    return [
        (
            "unknown",
            {"fc1.bias": torch.ones(HIDDEN, dtype=w.dtype), "nope": torch.ones(1)},
            "gradient for unknown parameter 'nope'",
        ),
        (
            "shape",
            {"fc1.weight": torch.ones(IN, HIDDEN, dtype=w.dtype)},
            "gradient for parameter 'fc1.weight' has shape (4, 8), expected (8, 4)",
        ),
        (
            "int",
            {"fc1.weight": torch.ones(w.shape, dtype=torch.int64)},
            "gradient for parameter 'fc1.weight' has non-floating dtype torch.int64",
        ),
        (
            "device",
            {"fc1.weight": torch.ones(w.shape, device="meta")},
            "gradient for parameter 'fc1.weight' is on meta, parameter is on cpu",
        ),
        (
            "not a tensor",
            {"fc1.weight": [1.0]},
            "gradient for parameter 'fc1.weight' is not a tensor: <class 'list'>",
        ),
        (
            "sparse",
            {"fc1.bias": torch.ones(HIDDEN, dtype=w.dtype).to_sparse()},
            "gradient for parameter 'fc1.bias' has layout torch.sparse_coo",
        ),
        (
            "unnamed",
            {1: torch.ones(HIDDEN, dtype=w.dtype)},
            "gradient for unknown parameter 1",
        ),
    ]


@pytest.mark.parametrize("weight", [2.0, 0.0], ids=["positive", "zero"])
@pytest.mark.parametrize(
    "case", range(7), ids=["unknown", "shape", "int", "device", "notensor", "sparse", "unnamed"]
)
def test_bad_gradient_is_rejected_without_mutation(case: int, weight: float) -> None:
    """Every supplied gradient is validated before anything is added, also at zero weight."""
    model, acc = primed(torch.float64)
    _, grads, message = _bad_gradients(model)[case]
    for method in (acc.accumulate_sum, acc.accumulate_mean):
        err = expect_rejected(acc, lambda m=method: m(grads, weight=weight), GradientError, message)
        assert isinstance(err, WeightedAccumulationError)


def test_weight_is_validated_before_gradients() -> None:
    model, acc = primed(torch.float64)
    bad = {"nope": torch.ones(1)}
    expect_rejected(
        acc, lambda: acc.accumulate_sum(bad, weight=math.nan), InvalidWeightError, WEIGHT_MSG
    )


def test_finish_mean_with_zero_weight_keeps_the_window() -> None:
    model = MLP(torch.float64)
    acc = WeightedGradientAccumulator(model, dtype=torch.float64)
    expect_rejected(acc, acc.finish_mean, EmptyWeightError, EMPTY_MSG)
    acc.accumulate_sum({"fc1.bias": torch.ones(HIDDEN, dtype=torch.float64)}, weight=0)
    acc.accumulate_mean(weight=0)
    expect_rejected(acc, acc.finish_mean, EmptyWeightError, EMPTY_MSG)
    assert acc.state.microbatches == 2
    acc.accumulate_sum({"fc1.bias": torch.full((HIDDEN,), 6.0, dtype=torch.float64)}, weight=3)
    result = acc.finish_mean()
    assert result.state.microbatches == 3
    assert torch.equal(
        result.gradients["fc1.bias"], torch.full((HIDDEN,), 2.0, dtype=torch.float64)
    )


@pytest.mark.parametrize(
    ("dtype", "loss_scale"),
    [
        (torch.float16, 1.0),
        (torch.bfloat16, 1.0),
        (torch.int64, 1.0),
        (torch.float64, 0.0),
        (torch.float64, -1.0),
        (torch.float64, math.nan),
        (torch.float64, math.inf),
        (torch.float32, 1e39),
        (torch.float32, 1e-50),
    ],
)
def test_invalid_dtype_or_loss_scale_at_construction(dtype: torch.dtype, loss_scale: float) -> None:
    with pytest.raises(GradientError, match="invalid (work dtype|scalar)"):
        WeightedGradientAccumulator(MLP(torch.float32), dtype=dtype, loss_scale=loss_scale)


# ------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_mid_window_checkpoint_resumes_bit_for_bit(
    tmp_path: Path, mode: str, dtype: torch.dtype
) -> None:
    model = MLP(dtype, seed=3, with_unused=True)
    x, y = make_data(17, dtype, 11)
    batches = split([6, 1, 0, 10], x, y)
    micro = [
        grads_of(model, F.cross_entropy(model(bx), by, reduction=mode) * 256.0)
        for bx, by in batches
    ]

    def feed(acc: WeightedGradientAccumulator, idx: range) -> None:
        for i in idx:
            method = acc.accumulate_sum if mode == "sum" else acc.accumulate_mean
            method(micro[i], weight=len(batches[i][1]))

    whole = WeightedGradientAccumulator(model, dtype=dtype, loss_scale=256.0)
    feed(whole, range(4))
    uninterrupted = whole.finish_mean()

    first = WeightedGradientAccumulator(model, dtype=dtype, loss_scale=256.0)
    feed(first, range(2))
    saved = round_trip(first.state_dict(), tmp_path)
    assert saved["state"]["microbatches"] == 2
    resumed = WeightedGradientAccumulator(model)  # default dtype/scale: the checkpoint's win
    resumed.load_state_dict(saved)
    assert resumed.state == first.state
    feed(resumed, range(2, 4))
    result = resumed.finish_mean()

    assert result.state == uninterrupted.state
    assert result.gradients.keys() == uninterrupted.gradients.keys()
    assert "unused" not in result.gradients
    for name, value in uninterrupted.gradients.items():
        assert torch.equal(result.gradients[name], value), name


def test_checkpoint_of_empty_window_round_trips(tmp_path: Path) -> None:
    model = MLP(torch.float32)
    acc = WeightedGradientAccumulator(model, loss_scale=4.0)
    acc.accumulate_sum(weight=0)
    other = WeightedGradientAccumulator(model)
    other.load_state_dict(round_trip(acc.state_dict(), tmp_path))
    assert other.state == WeightedAccumulationState(torch.float32, 4.0, 0.0, 1)


@pytest.mark.parametrize(
    ("name", "dtype"), [("F32", torch.float32), ("F64", torch.float64)], ids=["F32", "F64"]
)
def test_state_with_the_rust_dtype_name_loads(
    tmp_path: Path, name: str, dtype: torch.dtype
) -> None:
    """The Rust accumulator serializes its work dtype as the DType variant ("F32"/"F64"): such
    a record loads like ours and the window continues bit for bit; ours still writes
    "float32"/"float64"."""
    model, source = primed(dtype)
    saved = round_trip(source.state_dict(), tmp_path)
    assert saved["state"]["dtype"] == str(dtype).removeprefix("torch.")
    state = WeightedAccumulationState.from_dict({**saved["state"], "dtype": name})
    assert state == source.state
    resumed = WeightedGradientAccumulator(model, dtype=torch.float64, loss_scale=2.0)
    resumed.load_state_dict({**saved, "state": {**saved["state"], "dtype": name}})
    assert resumed.state == source.state
    for got, want in zip(
        resumed.finish_mean().gradients.values(),
        source.finish_mean().gradients.values(),
        strict=True,
    ):
        assert torch.equal(got, want)


def _state_edits() -> list[tuple[str, dict[str, Any], type[Exception], str, str | None]]:
    """(case, edit of a stored state of 1 microbatch of weight 3, error, str(error), detail)."""
    scalar = "invalid scalar: loss scale must be positive, finite and representable in "
    return [
        (
            "dtype f16",
            {"dtype": "float16"},
            InvalidStateError,
            STATE_MSG,
            DTYPE_DETAIL + "'float16'",
        ),
        ("dtype rust F16", {"dtype": "F16"}, InvalidStateError, STATE_MSG, DTYPE_DETAIL + "'F16'"),
        ("dtype lower f32", {"dtype": "f32"}, InvalidStateError, STATE_MSG, DTYPE_DETAIL + "'f32'"),
        (
            "dtype torch",
            {"dtype": "torch.float64"},
            InvalidStateError,
            STATE_MSG,
            DTYPE_DETAIL + "'torch.float64'",
        ),
        ("dtype int", {"dtype": 64}, InvalidStateError, STATE_MSG, DTYPE_DETAIL + "64"),
        (
            "negative total",
            {"total_weight": -1.0},
            InvalidStateError,
            STATE_MSG,
            "total_weight -1.0 is not a valid effective weight",
        ),
        (
            "nan total",
            {"total_weight": math.nan},
            InvalidStateError,
            STATE_MSG,
            "total_weight nan is not a valid effective weight",
        ),
        (
            "no batches",
            {"microbatches": 0, "total_weight": 3.0},
            InvalidStateError,
            STATE_MSG,
            "total_weight 3.0 with zero microbatches",
        ),
        (
            "counter > u64",
            {"microbatches": U64_MAX + 1},
            InvalidStateError,
            STATE_MSG,
            f"microbatches {U64_MAX + 1} is not an unsigned 64-bit integer",
        ),
        (
            "counter < 0",
            {"microbatches": -1},
            InvalidStateError,
            STATE_MSG,
            "microbatches -1 is not an unsigned 64-bit integer",
        ),
        (
            "counter float",
            {"microbatches": 2.0},
            InvalidStateError,
            STATE_MSG,
            "microbatches must be an integer, got 2.0",
        ),
        (
            "zero weight, pending",
            {"total_weight": 0.0},
            InvalidStateError,
            STATE_MSG,
            "pending gradients in a window with zero total weight",
        ),
        (
            "pending dtype",
            {"dtype": "float32"},
            InvalidStateError,
            STATE_MSG,
            "pending gradient 'fc1.weight' is torch.float64, work dtype is torch.float32",
        ),
        ("zero scale", {"loss_scale": 0.0}, GradientError, scalar + "float64, got 0.0", None),
        (
            "f32 scale overflow",
            {"dtype": "float32", "loss_scale": 1e39},
            GradientError,
            scalar + "float32, got 1e+39",
            None,
        ),
    ]


@pytest.mark.parametrize("case", range(15))
def test_inconsistent_checkpoint_state_is_rejected(tmp_path: Path, case: int) -> None:
    name, edit, error, message, detail = _state_edits()[case]
    model, source = primed(torch.float64)
    _, target = primed(torch.float64, seed=9)
    target.accumulate_sum(weight=0)
    sd = round_trip(source.state_dict(), tmp_path)
    sd["state"] = {**sd["state"], **edit}
    err = expect_rejected(target, lambda: target.load_state_dict(sd), error, message)
    assert err.detail == detail


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda g: {**g, "nope": torch.zeros(1, dtype=torch.float64)}, "'nope'"),
        (lambda g: {**g, "fc1.weight": torch.zeros(IN, HIDDEN, dtype=torch.float64)}, "shape"),
    ],
    ids=["unknown name", "wrong shape"],
)
def test_checkpoint_with_foreign_gradients_is_rejected(
    tmp_path: Path, edit: Callable[[dict], dict], message: str
) -> None:
    """Gradient names and shapes are checked against the model."""
    model, source = primed(torch.float64)
    sd = round_trip(source.state_dict(), tmp_path)
    sd["gradients"] = edit(sd["gradients"])
    _, target = primed(torch.float64, seed=9)
    expect_rejected(target, lambda: target.load_state_dict(sd), GradientError, message, exact=False)


def test_malformed_state_is_rejected() -> None:
    model, source = primed(torch.float64)
    _, target = primed(torch.float64, seed=9)
    expect_rejected(
        target, lambda: target.load_state_dict({"state": {}}), InvalidStateError, STATE_MSG
    )


def round_trip(state: dict, tmp_path: Path) -> dict:
    """Through a file, as the trainer's checkpoints store it (torch.save, weights only)."""
    torch.save(state, tmp_path / "accumulator.pt")
    return torch.load(tmp_path / "accumulator.pt", weights_only=True)


def test_state_dict_is_a_snapshot() -> None:
    model, acc = primed(torch.float64)
    sd = acc.state_dict()
    json.dumps(sd["state"])
    assert sd["state"]["dtype"] == "float64"
    acc.accumulate_sum({"fc1.bias": torch.ones(HIDDEN, dtype=torch.float64)}, weight=1)
    assert not torch.equal(acc.state_dict()["gradients"]["fc1.bias"], sd["gradients"]["fc1.bias"])


@pytest.mark.parametrize(
    ("state", "detail"),
    [
        ([1], "state must be a mapping, got list"),
        ({"dtype": "float64"}, "state is missing ['loss_scale', 'microbatches', 'total_weight']"),
        ({**F64_STATE, "dtype": 64}, DTYPE_DETAIL + "64"),
        ({**F64_STATE, "dtype": ["float64"]}, DTYPE_DETAIL + "['float64']"),  # unhashable
        ({**F64_STATE, "loss_scale": "2"}, "loss_scale must be a number, got '2'"),
        ({**F64_STATE, "total_weight": None}, "total_weight must be a number, got None"),
        ({**F64_STATE, "microbatches": 2.0}, "microbatches must be an integer, got 2.0"),
        ({**F64_STATE, "microbatches": True}, "microbatches must be an integer, got True"),
    ],
)
def test_stored_state_errors_name_the_reason(state: Any, detail: str) -> None:
    with pytest.raises(InvalidStateError) as info:
        WeightedAccumulationState.from_dict(state)
    assert (str(info.value), info.value.detail) == (STATE_MSG, detail)


def _state_dict_edits() -> list[tuple[Any, type[Exception], str, str | None]]:
    """(state dict, error, str(error), detail): what load_state_dict refuses, and why."""
    one = torch.ones(HIDDEN, dtype=torch.float64)
    entries = "state dict needs 'gradients' and 'state' entries"
    return [
        ([], InvalidStateError, STATE_MSG, entries),
        ({"state": F64_STATE}, InvalidStateError, STATE_MSG, entries),
        (
            {"gradients": {}, "state": {}},
            InvalidStateError,
            STATE_MSG,
            "state is missing ['dtype', 'loss_scale', 'microbatches', 'total_weight']",
        ),
        (
            {"gradients": [], "state": F64_STATE},
            InvalidStateError,
            STATE_MSG,
            "'gradients' must be a mapping name -> tensor",
        ),
        (
            {"gradients": {"fc1.bias": one}, "state": {**F64_STATE, "total_weight": 0.0}},
            InvalidStateError,
            STATE_MSG,
            "pending gradients in a window with zero total weight",
        ),
        (
            {"gradients": {"fc1.bias": [1.0]}, "state": F64_STATE},
            InvalidStateError,
            STATE_MSG,
            "pending gradient 'fc1.bias' is <class 'list'>, work dtype is torch.float64",
        ),
        (
            {"gradients": {"fc1.bias": one.float()}, "state": F64_STATE},
            InvalidStateError,
            STATE_MSG,
            "pending gradient 'fc1.bias' is torch.float32, work dtype is torch.float64",
        ),
        # devices are not checked: a pending gradient is moved to its parameter's device, and
        # one that cannot be moved (meta holds no data) is refused with the reason
        (
            {"gradients": {"fc1.bias": one.to("meta")}, "state": F64_STATE},
            GradientError,
            "pending gradient for parameter 'fc1.bias' cannot be moved to cpu: ",
            None,
        ),
    ]


@pytest.mark.parametrize("case", range(8))
def test_refused_state_dicts_name_the_reason_and_change_nothing(case: int) -> None:
    state_dict, error, message, detail = _state_dict_edits()[case]
    _, acc = primed(torch.float64)
    err = expect_rejected(acc, lambda: acc.load_state_dict(state_dict), error, message, False)
    assert str(err).startswith(message)
    assert err.detail == detail


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda m: WeightedGradientAccumulator(m, dtype=torch.float16),
            "invalid work dtype torch.float16: weighted accumulation needs torch.float32 or "
            "torch.float64",
        ),
        (
            lambda m: WeightedGradientAccumulator(m, loss_scale=-1.0),
            "invalid scalar: loss scale must be positive, finite and representable in float32, "
            "got -1.0",
        ),
        (
            lambda m: WeightedGradientAccumulator([("fc1.bias",)]),
            "expected (name, parameter) pairs, got ('fc1.bias',)",
        ),
        (
            lambda m: WeightedGradientAccumulator([("fc1.bias", 1.0)]),
            "expected (str, Tensor) pairs, got ('fc1.bias', <class 'float'>)",
        ),
        (
            lambda m: WeightedGradientAccumulator([(1, m.fc1.bias)]),
            "expected (str, Tensor) pairs, got (1, <class 'torch.nn.parameter.Parameter'>)",
        ),
        (
            lambda m: WeightedGradientAccumulator([("b", m.fc1.bias), ("b", m.fc2.bias)]),
            "duplicate parameter name 'b'",
        ),
        (
            lambda m: WeightedGradientAccumulator(m).accumulate_sum([m.fc1.bias], weight=1),
            "gradients must be a mapping name -> tensor, got <class 'list'>",
        ),
    ],
)
def test_bad_arguments_are_named(make: Callable[[nn.Module], object], message: str) -> None:
    with pytest.raises(GradientError) as info:
        make(MLP(torch.float32))
    assert str(info.value) == message


def test_a_state_of_another_dtype_is_written_by_its_name_and_refused_when_read() -> None:
    data = WeightedAccumulationState(torch.bfloat16, 1.0).to_dict()
    assert data == {"dtype": "bfloat16", "loss_scale": 1.0, "total_weight": 0.0, "microbatches": 0}
    with pytest.raises(InvalidStateError) as info:
        WeightedAccumulationState.from_dict(data)
    assert info.value.detail == DTYPE_DETAIL + "'bfloat16'"


def test_load_state_dict_copies_the_pending_gradients() -> None:
    """Changing the loaded snapshot's tensors afterwards does not reach the accumulator."""
    _, source = primed(torch.float64)
    snapshot = source.state_dict()
    _, target = primed(torch.float64, seed=9)
    target.load_state_dict(snapshot)
    want = {name: g.clone() for name, g in snapshot["gradients"].items()}
    for grad in snapshot["gradients"].values():
        grad.add_(1.0)
    got = target.state_dict()["gradients"]
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_float64_finish_divides_by_the_float64_weight() -> None:
    """2**24 + 1 is not a float32 value: the divisor is the window's float64 weight itself."""
    model = MLP(torch.float64)
    acc = WeightedGradientAccumulator(model, dtype=torch.float64, loss_scale=3.0)
    weight = float(2**24 + 1)
    acc.accumulate_sum({"fc1.bias": torch.full((HIDDEN,), 6.0, dtype=torch.float64)}, weight=weight)
    got = acc.finish_mean().gradients["fc1.bias"]
    assert got.tolist() == [6.0 / 3.0 / weight] * HIDDEN
    assert 2.0 / weight != 2.0 / float(torch.tensor(weight, dtype=torch.float32))


def test_zero_weight_finish_names_the_weight() -> None:
    acc = WeightedGradientAccumulator(MLP(torch.float64), dtype=torch.float64)
    err = expect_rejected(acc, acc.finish_mean, EmptyWeightError, EMPTY_MSG)
    assert err.detail == "total weight is 0.0"


def test_weight_limits_are_inclusive_and_a_one_element_tensor_is_a_weight() -> None:
    """float32 max is a float32 weight; the counter may reach 2**64 - 1; a one-element tensor
    weight is its value, a two-element one is refused."""
    f32_max = torch.finfo(torch.float32).max
    acc = WeightedGradientAccumulator(MLP(torch.float32), dtype=torch.float32)
    acc.accumulate_sum({}, weight=f32_max)
    assert acc.state.total_weight == f32_max
    acc = WeightedGradientAccumulator(MLP(torch.float64), dtype=torch.float64)
    state = WeightedAccumulationState(torch.float64, 1.0, 0.0, U64_MAX - 1).to_dict()
    acc.load_state_dict({"gradients": {}, "state": state})
    acc.accumulate_sum({}, weight=torch.tensor([3.0]))
    assert (acc.state.microbatches, acc.state.total_weight) == (U64_MAX, 3.0)
    with pytest.raises(InvalidWeightError):
        acc.accumulate_sum({}, weight=torch.tensor([1.0, 2.0]))


def test_float64_states_take_values_beyond_float32_and_float32_states_do_not() -> None:
    WeightedGradientAccumulator(MLP(torch.float64), dtype=torch.float64, loss_scale=1e39)
    big = {"dtype": "float64", "loss_scale": 1.0, "total_weight": 1e39, "microbatches": 1}
    assert WeightedAccumulationState.from_dict(big).total_weight == 1e39
    tiny = {"dtype": "float32", "loss_scale": 1.0, "total_weight": 1e-50, "microbatches": 1}
    with pytest.raises(InvalidStateError) as info:
        WeightedAccumulationState.from_dict(tiny)
    assert info.value.detail == "total_weight 1e-50 is not a valid effective weight"
