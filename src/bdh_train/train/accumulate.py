"""Exact weighted gradient accumulation over unequal microbatches.

Averaging per-microbatch mean losses weights a 3-token microbatch like a 300-token one, so the
accumulated gradient is not the gradient of the window's mean loss. This accumulator adds
gradients of loss SUMS (or mean losses multiplied back by their weight), remembers the total
effective weight, and divides once at the end, so any split of a window into microbatches gives
the gradient of the whole window's mean loss.

The caller states the loss scale it multiplied every loss by; it is never inferred from values.
Nothing else (optimizer, scheduler, clipping, data iterator, reduction) is advanced here. The
pending window and its counters can be checkpointed mid-window and resumed bit for bit.

Every validation rule, its order and its message follow the Rust weighted accumulator this
product ports, so errors read the same in both.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from bdh_train.errors import BDHTrainError

__all__ = [
    "U64_MAX",
    "AccumulatedGradients",
    "CounterOverflowError",
    "EmptyWeightError",
    "GradientError",
    "InvalidStateError",
    "InvalidWeightError",
    "NamedParams",
    "WeightedAccumulationError",
    "WeightedAccumulationState",
    "WeightedGradientAccumulator",
    "named_parameter_dict",
    "normalize_gradients",
    "write_to_params",
]

U64_MAX = 2**64 - 1
"""The microbatch counter is an unsigned 64-bit integer, as in the reference."""

GRADS_FILE = "grads.safetensors"
STATE_FILE = "state.json"

_DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.float64: "float64"}
_NAME_DTYPES: dict[str, torch.dtype] = {
    **{name: dtype for dtype, name in _DTYPE_NAMES.items()},
    "F32": torch.float32,
    "F64": torch.float64,
}
"""The dtype names a stored state may carry: ours, and the Rust accumulator's (its serialized
DType variants, case as written)."""
_F32_MAX = torch.finfo(torch.float32).max

NamedParams = nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
GradientMap = Mapping[str, torch.Tensor | None]


# --------------------------------------------------------------------------------------------
# Errors: one class per reference error kind, with the reference's message text.
# --------------------------------------------------------------------------------------------


class WeightedAccumulationError(BDHTrainError, ValueError):
    """An invalid accumulation argument, gradient geometry or checkpoint.

    Kinds with a fixed reference message keep it exactly as `str(error)`; the specific reason
    is kept in `detail` (and attached as an exception note) so callers can still match text.
    """

    message: ClassVar[str] = ""

    def __init__(self, detail: str | None = None) -> None:
        super().__init__(self.message)
        self.detail = detail
        if detail:
            self.add_note(detail)


class InvalidWeightError(WeightedAccumulationError):
    """A weight (or the new running total) that is negative, non-finite or unrepresentable."""

    message = "effective accumulation weight must be finite, nonnegative and representable"


class CounterOverflowError(WeightedAccumulationError):
    """The unsigned 64-bit microbatch counter cannot take another increment."""

    message = "accumulation microbatch counter overflow"


class EmptyWeightError(WeightedAccumulationError):
    """A mean needs positive total weight; the pending window is left intact."""

    message = "cannot normalize an accumulation window with zero effective weight"


class InvalidStateError(WeightedAccumulationError):
    """Stored counters/options describe an inconsistent accumulation window."""

    message = "inconsistent weighted accumulation checkpoint state"


class GradientError(WeightedAccumulationError):
    """Invalid work dtype, scalar or gradient metadata; the message names the parameter."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.detail = None


# --------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    """A real number that is not a bool (True is not a weight)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _to_float32(value: float) -> float:
    """Round a finite double to the nearest float32 (0.0 on underflow)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _representable(value: float, dtype: torch.dtype) -> bool:
    """Finite, and inside the range of `dtype` (float32 values must not overflow)."""
    if not math.isfinite(value):
        return False
    return dtype == torch.float64 or abs(value) <= _F32_MAX


def _flushes_to_zero(value: float, dtype: torch.dtype) -> bool:
    """A non-zero double that becomes 0 in float32 would silently drop a whole microbatch."""
    return value != 0.0 and dtype == torch.float32 and _to_float32(value) == 0.0


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class WeightedAccumulationState:
    """Normalization and continuation state of one accumulation window.

    dtype: float32 or float64, the arithmetic every microbatch's gradients are added in.
    loss_scale: the fixed multiplier the caller applied to every loss in the window.
    total_weight: sum of the effective token/sample weights (not the microbatch count).
    microbatches: accepted microbatches, zero-weight ones included (unsigned 64-bit).
    """

    dtype: torch.dtype
    loss_scale: float
    total_weight: float = 0.0
    microbatches: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values; the dtype as "float32"/"float64"."""
        return {
            "dtype": _dtype_name(self.dtype),
            "loss_scale": float(self.loss_scale),
            "total_weight": float(self.total_weight),
            "microbatches": int(self.microbatches),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WeightedAccumulationState:
        """Parse `to_dict` output (or a state whose dtype is the Rust accumulator's "F32" or
        "F64") and validate it; raises a WeightedAccumulationError."""
        if not isinstance(data, Mapping):
            raise InvalidStateError(f"state must be a mapping, got {type(data).__name__}")
        missing = {"dtype", "loss_scale", "total_weight", "microbatches"} - set(data)
        if missing:
            raise InvalidStateError(f"state is missing {sorted(missing)}")
        dtype = _NAME_DTYPES.get(data["dtype"]) if isinstance(data["dtype"], str) else None
        if dtype is None:
            raise InvalidStateError(
                "weighted accumulation dtype must be 'float32' or 'float64' ('F32' or 'F64' as "
                f"the Rust accumulator writes them), got {data['dtype']!r}"
            )
        for key in ("loss_scale", "total_weight"):
            if not _is_number(data[key]):
                raise InvalidStateError(f"{key} must be a number, got {data[key]!r}")
        microbatches = data["microbatches"]
        if not isinstance(microbatches, int) or isinstance(microbatches, bool):
            raise InvalidStateError(f"microbatches must be an integer, got {microbatches!r}")
        state = cls(dtype, float(data["loss_scale"]), float(data["total_weight"]), microbatches)
        _validate_state(state)
        return state


def _validate_work_dtype(dtype: object) -> None:
    if dtype not in _DTYPE_NAMES:
        raise GradientError(
            f"invalid work dtype {dtype!r}: weighted accumulation needs torch.float32 or "
            f"torch.float64"
        )


def _validate_state(state: WeightedAccumulationState) -> None:
    """The reference's `validate_state`, in its order."""
    _validate_work_dtype(state.dtype)
    scale = state.loss_scale
    if (
        not _is_number(scale)
        or not _representable(float(scale), state.dtype)
        or scale <= 0.0
        or _flushes_to_zero(float(scale), state.dtype)
    ):
        raise GradientError(
            f"invalid scalar: loss scale must be positive, finite and representable in "
            f"{_dtype_name(state.dtype)}, got {scale!r}"
        )
    total = state.total_weight
    if (
        not _is_number(total)
        or not total >= 0.0
        or not _representable(float(total), state.dtype)
        or _flushes_to_zero(float(total), state.dtype)
    ):
        raise InvalidStateError(f"total_weight {total!r} is not a valid effective weight")
    count = state.microbatches
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= U64_MAX:
        raise InvalidStateError(f"microbatches {count!r} is not an unsigned 64-bit integer")
    if count == 0 and total != 0.0:
        raise InvalidStateError(f"total_weight {total!r} with zero microbatches")


@dataclass
class AccumulatedGradients:
    """Result of a finished window: only gradients that were produced, and the window state."""

    gradients: dict[str, torch.Tensor]
    state: WeightedAccumulationState

    def write_to(self, model_or_named_params: NamedParams) -> None:
        """Copy these gradients into the parameters' `.grad` (see `write_to_params`)."""
        write_to_params(self.gradients, model_or_named_params)


# --------------------------------------------------------------------------------------------
# Parameters and gradient validation
# --------------------------------------------------------------------------------------------


def named_parameter_dict(model_or_named_params: NamedParams) -> dict[str, torch.Tensor]:
    """Name -> parameter for a module, a mapping or an iterable of (name, parameter) pairs."""
    if isinstance(model_or_named_params, nn.Module):
        return dict(model_or_named_params.named_parameters())
    if isinstance(model_or_named_params, Mapping):
        pairs: Iterable[Any] = model_or_named_params.items()
    else:
        pairs = model_or_named_params
    params: dict[str, torch.Tensor] = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise GradientError(f"expected (name, parameter) pairs, got {pair!r}")
        name, param = pair
        if not isinstance(name, str) or not isinstance(param, torch.Tensor):
            raise GradientError(f"expected (str, Tensor) pairs, got ({name!r}, {type(param)})")
        if name in params:
            raise GradientError(f"duplicate parameter name {name!r}")
        params[name] = param
    return params


def _check_gradient(
    name: object, grad: object, params: Mapping[str, torch.Tensor], check_device: bool = True
) -> torch.Tensor:
    """Reject a gradient that does not fit its parameter; the message names the parameter."""
    if not isinstance(name, str) or name not in params:
        raise GradientError(f"gradient for unknown parameter {name!r}")
    if not isinstance(grad, torch.Tensor):
        raise GradientError(f"gradient for parameter {name!r} is not a tensor: {type(grad)}")
    param = params[name]
    if grad.layout != torch.strided:
        raise GradientError(f"gradient for parameter {name!r} has layout {grad.layout}")
    if grad.shape != param.shape:
        raise GradientError(
            f"gradient for parameter {name!r} has shape {tuple(grad.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    if not grad.is_floating_point():
        raise GradientError(f"gradient for parameter {name!r} has non-floating dtype {grad.dtype}")
    if check_device and grad.device != param.device:
        raise GradientError(
            f"gradient for parameter {name!r} is on {grad.device}, parameter is on {param.device}"
        )
    return grad


def _collect_gradients(
    grads: GradientMap | None, params: Mapping[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Validate every supplied gradient before anything is scaled or added."""
    if grads is None:
        items: Iterable[tuple[Any, Any]] = (
            (name, p.grad) for name, p in params.items() if p.grad is not None
        )
    elif isinstance(grads, Mapping):
        items = ((name, g) for name, g in grads.items() if g is not None)
    else:
        raise GradientError(f"gradients must be a mapping name -> tensor, got {type(grads)}")
    return [(name, _check_gradient(name, g, params)) for name, g in items]


def _scalar_like(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor in `like`'s dtype and device.

    Dividing by a Python scalar lets CUDA multiply by its reciprocal instead; a same-device
    tensor keeps true division (and makes the work-dtype rounding of the scalar explicit).
    """
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def normalize_gradients(
    gradients: Mapping[str, torch.Tensor], loss_scale: float, total_weight: float
) -> dict[str, torch.Tensor]:
    """Divide by the loss scale and then by the total weight, never by their product.

    The product can overflow (or round differently) where the two divisions do not.
    """
    if not total_weight > 0.0:
        raise EmptyWeightError(f"total weight is {total_weight!r}")
    out: dict[str, torch.Tensor] = {}
    for name, grad in gradients.items():
        unscaled = grad / _scalar_like(loss_scale, grad)
        out[name] = unscaled / _scalar_like(total_weight, grad)
    return out


def write_to_params(
    gradients: Mapping[str, torch.Tensor], model_or_named_params: NamedParams
) -> None:
    """Set each parameter's `.grad` from `gradients` (cast to its dtype and device).

    Parameters absent from `gradients` get `.grad = None`, so an optimizer skips them instead
    of applying an invented zero gradient (which would still move them under weight decay).
    Everything is validated before any `.grad` is touched.
    """
    params = named_parameter_dict(model_or_named_params)
    checked = {name: _check_gradient(name, g, params, False) for name, g in gradients.items()}
    for name, param in params.items():
        grad = checked.get(name)
        param.grad = (
            None
            if grad is None
            else grad.detach().to(device=param.device, dtype=param.dtype, copy=True)
        )


# --------------------------------------------------------------------------------------------
# The accumulator
# --------------------------------------------------------------------------------------------


class WeightedGradientAccumulator:
    """Unequal-microbatch gradient accumulation with an explicit, resumable weight.

    For each microbatch pass the gradients of either its loss SUM (`accumulate_sum`) or its
    loss MEAN (`accumulate_mean`) together with its effective weight (tokens or samples, not
    the loss multiplier). Use one loss scale for every forward/backward in the window.
    """

    def __init__(
        self,
        model_or_named_params: NamedParams,
        dtype: torch.dtype = torch.float32,
        loss_scale: float = 1.0,
    ) -> None:
        state = WeightedAccumulationState(dtype, loss_scale, 0.0, 0)
        _validate_state(state)
        self._params = named_parameter_dict(model_or_named_params)
        self._state = replace(state, loss_scale=float(loss_scale))
        self._pending: dict[str, torch.Tensor] = {}

    @property
    def state(self) -> WeightedAccumulationState:
        """Current counters; reading them does not clear anything."""
        return self._state

    @property
    def pending_names(self) -> list[str]:
        """Parameters that have received a gradient in the current window."""
        return list(self._pending)

    def accumulate_sum(self, grads: GradientMap | None = None, *, weight: float) -> None:
        """Add gradients of a loss SUM whose effective token/sample count is `weight`.

        `grads` maps parameter names to gradients (None values are skipped); `grads=None`
        reads the parameters' `.grad`, skipping parameters whose `.grad` is None.
        A zero weight adds nothing but counts as a microbatch (its gradients are validated).
        """
        self._accumulate(grads, weight, mean=False)

    def accumulate_mean(self, grads: GradientMap | None = None, *, weight: float) -> None:
        """Add gradients of a MEAN loss, multiplied by `weight` after work-dtype conversion.

        Unequal microbatches are therefore weighted by their size, not averaged equally.
        """
        self._accumulate(grads, weight, mean=True)

    def _accumulate(self, grads: GradientMap | None, weight: float, mean: bool) -> None:
        state = self._state
        dtype = state.dtype
        if isinstance(weight, torch.Tensor) and weight.numel() == 1:
            weight = weight.item()
        if (
            not _is_number(weight)
            or not weight >= 0.0
            or not _representable(float(weight), dtype)
            or _flushes_to_zero(float(weight), dtype)
        ):
            raise InvalidWeightError(f"weight {weight!r} in {_dtype_name(dtype)}")
        weight = float(weight)
        total = state.total_weight + weight
        if not _representable(total, dtype):
            raise InvalidWeightError(f"new total weight {total!r} in {_dtype_name(dtype)}")
        count = state.microbatches + 1
        if count > U64_MAX:
            raise CounterOverflowError()
        # Validate every supplied gradient before any scaling or addition, so a rejected call
        # leaves the pending gradients and the counters untouched.
        items = _collect_gradients(grads, self._params)
        if weight > 0.0:
            values: list[tuple[str, torch.Tensor]] = []
            for name, grad in items:
                value = grad.detach().to(dtype=dtype, copy=True)
                if mean:
                    value.mul_(_scalar_like(weight, value))
                values.append((name, value))
            for name, value in values:
                if name in self._pending:
                    self._pending[name].add_(value)
                else:
                    self._pending[name] = value
        self._state = replace(state, total_weight=total, microbatches=count)

    def _reset(self) -> None:
        self._pending = {}
        self._state = replace(self._state, total_weight=0.0, microbatches=0)

    def finish_sums(self) -> AccumulatedGradients:
        """Return the scaled loss-sum gradients and the window's state, then reset.

        For a distributed reduction of sums and weights (see `distributed.reduce`); the caller
        must divide by `state.loss_scale` exactly once after reducing.
        """
        result = AccumulatedGradients(self._pending, self._state)
        self._reset()
        return result

    def finish_mean(self) -> AccumulatedGradients:
        """Divide by the loss scale and then by the total weight, return, and reset.

        Zero total weight raises EmptyWeightError and clears nothing.
        """
        gradients = normalize_gradients(
            self._pending, self._state.loss_scale, self._state.total_weight
        )
        result = AccumulatedGradients(gradients, self._state)
        self._reset()
        return result

    def state_dict(self) -> dict[str, Any]:
        """Pending gradients (full precision, work dtype, cloned) and the state, together."""
        return {
            "gradients": {name: g.detach().clone() for name, g in self._pending.items()},
            "state": self._state.to_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a mid-window snapshot; on any error this accumulator is unchanged.

        Like the reference, the snapshot's dtype and loss scale replace this accumulator's:
        its pending gradients were scaled with them, so the window must continue with them.
        """
        if not isinstance(state_dict, Mapping) or not {"gradients", "state"} <= set(state_dict):
            raise InvalidStateError("state dict needs 'gradients' and 'state' entries")
        state = WeightedAccumulationState.from_dict(state_dict["state"])
        gradients = state_dict["gradients"]
        if not isinstance(gradients, Mapping):
            raise InvalidStateError("'gradients' must be a mapping name -> tensor")
        if state.total_weight == 0.0 and len(gradients) > 0:
            raise InvalidStateError("pending gradients in a window with zero total weight")
        for name, grad in gradients.items():
            if not isinstance(grad, torch.Tensor) or grad.dtype != state.dtype:
                found = grad.dtype if isinstance(grad, torch.Tensor) else type(grad)
                raise InvalidStateError(
                    f"pending gradient {name!r} is {found}, work dtype is {state.dtype}"
                )
        for name, grad in gradients.items():
            _check_gradient(name, grad, self._params, check_device=False)
        restored: dict[str, torch.Tensor] = {}
        for name, grad in gradients.items():
            device = self._params[name].device
            try:
                restored[name] = grad.detach().to(device=device, copy=True)
            except (RuntimeError, NotImplementedError) as exc:
                raise GradientError(
                    f"pending gradient for parameter {name!r} cannot be moved to {device}: {exc}"
                ) from exc
        self._pending = restored
        self._state = state


# --------------------------------------------------------------------------------------------
# Files: grads.safetensors + state.json
# --------------------------------------------------------------------------------------------
