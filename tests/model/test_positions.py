"""rope's complex multiply (with its hand-written backward) against the rotation written out;
the decay powers."""

from __future__ import annotations

import pytest
import torch

from bdh_train.model.matmul import is_heads_major
from bdh_train.model.positions import apply_rope, decay_powers, rope_cos_sin, rotate_pairs


def rope_inputs(dtype):
    torch.manual_seed(3)
    v = torch.randn(2, 3, 7, 8, dtype=dtype)
    positions = torch.arange(5, 12).view(1, 7).expand(2, 7)
    cos, sin = rope_cos_sin(positions, 8, dtype)
    return v, cos, sin


@pytest.mark.parametrize("heads_major", [False, True], ids=["contiguous", "heads-major"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_rope_equals_the_rotation_written_out(heads_major, dtype, tol):
    """apply_rope (one complex multiply per pair, backward by the conjugate turn) against
    v*cos + rot(v)*sin under autograd, values and gradients; a heads-major input and
    gradient keep their layout (no copy) through forward and backward."""
    v, cos, sin = rope_inputs(dtype)
    if heads_major:
        v = v.transpose(0, 1).contiguous().transpose(0, 1)
    v.requires_grad_()
    out = apply_rope(v, cos, sin)
    assert type(out.grad_fn).__name__ == "_TurnPairsBackward"
    expected = v * cos + rotate_pairs(v) * sin
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert is_heads_major(out) == heads_major
    g = torch.randn(out.shape[1], out.shape[0], *out.shape[2:], dtype=dtype).transpose(0, 1)
    g = g if heads_major else g.contiguous()
    (got,) = torch.autograd.grad(out, v, g)
    (ref,) = torch.autograd.grad(expected, v, g)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    assert is_heads_major(got) == heads_major


def test_rope_backward_is_autograds_bit_for_bit():
    """The hand-written backward computes what autograd through the complex multiply does."""
    v, cos, sin = rope_inputs(torch.float32)
    v.requires_grad_()
    pairs = torch.view_as_complex(v.reshape(2, 3, 7, 4, 2))
    turn = torch.complex(cos[..., ::2], sin[..., ::2])
    reference = torch.view_as_real(pairs * turn).reshape(v.shape)
    out = apply_rope(v, cos, sin)
    g = torch.randn_like(out)
    assert torch.equal(out, reference)
    assert torch.equal(torch.autograd.grad(out, v, g)[0], torch.autograd.grad(reference, v, g)[0])


def test_phases_with_a_gradient_get_it():
    """cos and sin that require a gradient take the complex multiply under autograd, which
    differentiates them too."""
    v, cos, sin = rope_inputs(torch.float64)
    cos.requires_grad_()
    sin.requires_grad_()
    out = apply_rope(v, cos, sin)
    assert type(out.grad_fn).__name__ != "_TurnPairsBackward"
    expected = v * cos + rotate_pairs(v) * sin
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (cos, sin), g)
    ref = torch.autograd.grad(expected, (cos, sin), g)
    for a, b in zip(got, ref, strict=True):  # rope pairs share a phase: the pair's sum
        torch.testing.assert_close(a[..., ::2] + a[..., 1::2], b[..., ::2] + b[..., 1::2])


def test_rope_backward_takes_gradients_of_any_layout():
    """A broadcast gradient (stride 0, from .sum()), a strided one (odd offsets) and a
    contiguous one give the rotation's gradient alike."""
    v, cos, sin = rope_inputs(torch.float64)
    v.requires_grad_()
    apply_rope(v, cos, sin).sum().backward()
    expected = torch.autograd.grad((v * cos + rotate_pairs(v) * sin).sum(), v)[0]
    torch.testing.assert_close(v.grad, expected, rtol=1e-12, atol=1e-12)
    wide = torch.randn(2, 3, 7, 9, dtype=torch.float64)[..., 1:]  # offset 1, row stride 9
    (got,) = torch.autograd.grad(apply_rope(v, cos, sin), v, wide)
    (ref,) = torch.autograd.grad(v * cos + rotate_pairs(v) * sin, v, wide)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("dtype", "first_cut"),
    [(torch.float64, 355), (torch.float32, 44), (torch.bfloat16, 44), (torch.float16, 44)],
)
def test_decay_powers_are_exact_and_negligible_ones_zero(dtype, first_cut):
    """d^e rounded once from float64, per head; powers below sqrt(tiny) (which would drive
    products into denormal numbers) are exactly 0, every other one kept. The bound is
    float32's for the narrower dtypes (float16's own, 7.8e-3, would cut alibi's head 0 after
    5 tokens): e^-44 < 1.08e-19 <= e^-43."""
    log_decay = torch.tensor([-1.0, -0.25], dtype=torch.float64)
    exponents = torch.arange(0, 2000)
    got = decay_powers(log_decay, exponents, torch.empty(0, dtype=dtype))
    exact = torch.exp(log_decay.view(-1, 1) * exponents.to(torch.float64))
    wide = torch.promote_types(dtype, torch.float32)
    kept = exact >= torch.finfo(wide).tiny ** 0.5
    assert got.dtype == dtype and got.shape == (2, 2000)
    assert torch.equal(got[kept], exact[kept].to(dtype))
    assert torch.equal(got[~kept], torch.zeros_like(got[~kept]))
    assert kept[0, first_cut - 1] and not kept[0, first_cut]
