"""The fused gate (model/gate.py) against autograd's x * relu(pre): bit-identical values and
gradients from its kernels run eagerly and compiled, and through the whole model (dropout,
recomputation, QAT, carried state) with the same weights."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from torch.utils.flop_counter import FlopCounterMode

from bdh_train.model import QuantConfig
from bdh_train.model.bdh import COMPILE_MODES, compile_mode_for
from bdh_train.model.gate import GateKernels, gate, gate_backward, gate_forward

DTYPES = [torch.float32, torch.float64]


def _operands(shape, dtype, heads_major: bool, seed: int = 0):
    """x >= 0 with zeros of both signs, pre of both signs with zeros of both signs (relu's
    mask edge) and NaNs, and an upstream gradient, [B, H, T, N]; heads_major: laid out as
    [H, B, T, N] (the projections' per-head results)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype).relu()
    x[..., 1::9] = -0.0
    pre = torch.randn(shape, generator=g, dtype=dtype)
    pre[..., ::7] = 0.0
    pre[..., 3::7] = -0.0
    pre[..., 5::11] = float("nan")
    grad = torch.randn(shape, generator=g, dtype=dtype)
    if heads_major:
        x, pre = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (x, pre))
    return x, pre, grad


def _autograd_gate(x, pre, grad, wants=(True, True)):
    x, pre = x.clone().requires_grad_(wants[0]), pre.clone().requires_grad_(wants[1])
    out = x * torch.relu(pre)
    grads = torch.autograd.grad(out, [t for t in (x, pre) if t.requires_grad], grad)
    return out.detach(), grads


class CountingKernels(GateKernels):
    """The eager kernels, counting their calls."""

    def __init__(self) -> None:
        super().__init__(compiled=False)
        self.calls = {"forward": 0, "backward": 0}
        for name in self.calls:
            setattr(self, name, self._counted(name, getattr(self, name)))

    def _counted(self, name, kernel):
        def call(*args):
            self.calls[name] += 1
            return kernel(*args)

        return call


def _fused_gate(x, pre, grad, kernels, wants=(True, True)):
    x, pre = x.clone().requires_grad_(wants[0]), pre.clone().requires_grad_(wants[1])
    out = gate(x, pre, kernels)
    assert type(out.grad_fn).__name__ == "_FusedGateBackward"
    grads = torch.autograd.grad(out, [t for t in (x, pre) if t.requires_grad], grad)
    return out.detach(), grads


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """The same bits (the sign of a zero included), NaN wherever the other is NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    a, b = (torch.where(nan, 0.0, t).contiguous().view(bits) for t in (a, b))
    assert torch.equal(a, b)


def _assert_identical(got, want):
    (out, grads), (want_out, want_grads) = got, want
    assert_bits_equal(out, want_out)
    assert len(grads) == len(want_grads)
    for a, b in zip(grads, want_grads, strict=True):
        assert_bits_equal(a, b)


@pytest.mark.parametrize("heads_major", [False, True], ids=["contiguous", "heads-major"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_kernels_equal_autograd_bit_for_bit(dtype, heads_major):
    x, pre, grad = _operands((2, 3, 5, 8), dtype, heads_major)
    kernels = CountingKernels()
    for wants in ((True, True), (True, False), (False, True)):  # a frozen side gets no grad
        _assert_identical(
            _fused_gate(x, pre, grad, kernels, wants), _autograd_gate(x, pre, grad, wants)
        )
    assert kernels.calls == {"forward": 3, "backward": 3}
    with torch.no_grad():  # no gradient recorded: autograd's form, the kernels untouched
        assert_bits_equal(gate(x, pre, kernels), x * torch.relu(pre))
    assert_bits_equal(gate(x, pre, kernels), x * torch.relu(pre))  # nothing requires grad
    assert kernels.calls == {"forward": 3, "backward": 3}
    assert_bits_equal(gate(x, pre, None), x * torch.relu(pre))  # no kernels: autograd's form


def test_second_order_gradients_equal_autograds():
    """Backward with create_graph records the eager form, so a loss on the gradients
    differentiates through the gate (float64, 1e-12)."""
    results = []
    for kernels in (None, CountingKernels()):
        x, pre, grad = _operands((2, 3, 5, 8), torch.float64, heads_major=False, seed=4)
        pre = pre.nan_to_num(0.5)
        w = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        w.requires_grad_()
        x, pre = x.requires_grad_(), pre.requires_grad_()
        grad_x, grad_pre = torch.autograd.grad(
            gate(x * w, pre, kernels), (x, pre), grad, create_graph=True
        )
        loss = grad_x.square().sum() + (grad_pre * pre).sum()
        results.append(torch.autograd.grad(loss, (w, x, pre), allow_unused=True))
        if kernels is not None:
            assert kernels.calls["backward"] == 0  # create_graph takes the eager form
    for got, want in zip(*results, strict=True):
        assert want is not None
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_uncompiled_kernels_are_the_functions_as_written():
    plain = GateKernels(compiled=False)
    assert (plain.forward, plain.backward, plain.compiled) == (gate_forward, gate_backward, False)


def test_the_backward_kernel_masks_where_pre_is_not_positive():
    """relu's mask on the pre side only: x's gradient is grad * relu(pre) wherever x is."""
    x = torch.tensor([0.0, 2.0, 3.0, 4.0])
    pre = torch.tensor([1.0, 0.0, -1.0, 5.0])
    grad = torch.tensor([10.0, 20.0, 30.0, 40.0])
    grad_x, grad_pre = GateKernels(compiled=False).backward(grad, x, pre)
    assert grad_x.tolist() == [10.0, 0.0, 0.0, 200.0]
    assert grad_pre.tolist() == [0.0, 0.0, 0.0, 160.0]


@pytest.mark.compiles
def test_compiled_kernels_equal_eager_and_build_once_for_every_shape():
    """Inductor's kernels against autograd's gate, bit for bit, for two batches and lengths
    (a TBPTT tail) in float32: one forward and one backward graph, never rebuilt (a rebuild
    raises); then the heads-major layout (graphs of its own) and float64."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    kernels = GateKernels(compiled=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for shape in ((2, 3, 16, 8), (3, 3, 5, 8)):
            x, pre, grad = _operands(shape, torch.float32, heads_major=False, seed=shape[2])
            _assert_identical(_fused_gate(x, pre, grad, kernels), _autograd_gate(x, pre, grad))
    assert counters["stats"]["unique_graphs"] == 2
    for dtype, heads_major in ((torch.float32, True), (torch.float64, False)):
        x, pre, grad = _operands((2, 3, 16, 8), dtype, heads_major, seed=7)
        _assert_identical(_fused_gate(x, pre, grad, kernels), _autograd_gate(x, pre, grad))
    with FlopCounterMode(display=False):  # dynamo compiles nothing under a dispatch mode
        x, pre, grad = _operands((2, 3, 16, 8), torch.float32, heads_major=False, seed=8)
        _assert_identical(_fused_gate(x, pre, grad, kernels), _autograd_gate(x, pre, grad))


CASES = {
    "plain": {},
    "dropout": {"dropout": 0.3},
    "qat": {"quant": QuantConfig(enable=True, warmup_steps=4)},
    "chunked": {"executor": "chunked"},
}


def _gradients(case: str, recompute: str, kernels: GateKernels | None):
    """Loss and gradients (parameters and incoming states) of two calls that carry a state,
    with a reset in row 0, in float32."""
    model = tiny_model(torch.float32, seed=1, **CASES[case])
    model.set_recompute(recompute)
    model.use_fused_gate(kernels)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 32, (2, 10), generator=g)
    targets = torch.randint(0, 32, (2, 10), generator=g)
    resets = torch.zeros(2, 10, dtype=torch.bool)
    resets[0, 3] = True
    c = model.config
    state = model.init_state(2)
    state.rho = [
        torch.randn(2, c.n_head, c.n_neurons, c.n_embd, generator=g).mul_(0.1).requires_grad_()
        for _ in range(c.n_layer)
    ]
    incoming = list(state.rho)
    torch.manual_seed(3)  # the dropout draws
    hidden = [
        model.forward_hidden(idx[:, a:b], state, reset_mask=resets[:, a:b])
        for a, b in ((0, 6), (6, 10))
    ]
    loss = model.loss_from_hidden(torch.cat(hidden, dim=1), targets)
    grads = torch.autograd.grad(loss, [*model.parameters(), *incoming], allow_unused=True)
    with torch.no_grad():  # evaluation
        model.eval()
        logits, _ = model(idx)
    return loss.detach(), [g for g in grads if g is not None], logits


@pytest.mark.parametrize("recompute", ["none", "layer", "mixer"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_model_with_the_fused_gate_trains_bit_for_bit_like_autograds(case, recompute):
    want_loss, want_grads, want_logits = _gradients(case, recompute, None)
    kernels = CountingKernels()
    loss, grads, logits = _gradients(case, recompute, kernels)
    layer_calls = 2 * 2  # two layers, two calls (evaluation runs autograd's form)
    forwards = layer_calls * (2 if recompute == "layer" else 1)  # 'layer' runs it again
    assert kernels.calls == {"forward": forwards, "backward": layer_calls}
    assert_bits_equal(loss, want_loss)
    assert len(grads) == len(want_grads) > 5
    for a, b in zip(grads, want_grads, strict=True):
        assert_bits_equal(a, b)
    assert_bits_equal(logits, want_logits)


@pytest.mark.compiles
@pytest.mark.parametrize("recompute", ["layer", "mixer"])
def test_the_model_with_compiled_kernels_trains_bit_for_bit_like_autograds(recompute):
    """Inductor's kernels in the model: dropout, QAT's blends and recomputation."""
    for case in ("dropout", "qat"):
        want_loss, want_grads, _ = _gradients(case, recompute, None)
        loss, grads, _ = _gradients(case, recompute, GateKernels(compiled=True))
        assert_bits_equal(loss, want_loss)
        for a, b in zip(grads, want_grads, strict=True):
            assert_bits_equal(a, b)


def test_compile_for_training_applies_each_mode():
    """'auto' on the CPU is the fused gate (nothing is built until a call); 'layer' the
    compiled layer; 'off' neither; anything else is refused."""
    assert COMPILE_MODES == ("off", "layer", "pointwise", "auto")
    for mode, gated, layer in (
        ("off", False, False),
        ("pointwise", True, False),
        ("auto", True, False),
        ("layer", False, True),
    ):
        model = tiny_model()
        model.compile_for_training(mode)
        kernels = model._gate_kernels
        assert (kernels is not None, model._compiled_layer is not None) == (gated, layer), mode
        assert kernels is None or kernels.compiled
    with pytest.raises(ValueError, match="unknown compile mode 'fast'"):
        tiny_model().compile_for_training("fast")


def test_auto_compiles_the_layer_on_cuda_and_the_gate_elsewhere():
    for mode in ("off", "layer", "pointwise"):
        assert compile_mode_for(mode, torch.device("cuda")) == mode
        assert compile_mode_for(mode, torch.device("cpu")) == mode
    assert compile_mode_for("auto", torch.device("cuda")) == "layer"
    assert compile_mode_for("auto", torch.device("cpu")) == "pointwise"
    with pytest.raises(ValueError, match="unknown compile mode 'true'"):
        compile_mode_for("true", torch.device("cpu"))
