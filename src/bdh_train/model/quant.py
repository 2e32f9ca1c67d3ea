"""BitNet b1.58 quantization-aware training of BDH's three shared projections.

BDH spends almost all of its weights and multiply-adds in three projections, so those are what
low-bit training targets (paper names on the left, BDH parameter on the right):

    decoder_x -> u @ encoder     [.., D] @ [H, D, N]
    decoder_y -> a @ encoder_v   [.., D] @ [H, D, N]
    encoder   -> y @ decoder     [.., H*N] @ [H*N, D]

A targeted projection quantizes its input to int8 and its weight to ternary {-1, 0, +1} * gamma
(or int8). Quantizers return integer *codes* plus a *scale*, so the same numbers serve the
fake-quant reference, the integer kernel, the int8 saved-activation cache and the export.

Reductions (why these):
* weights: ONE gamma per tensor, gamma = mean|W| over the whole [H, D, N] (or [H*N, D]) tensor.
  This is the paper's per-tensor rule; it keeps a single ternary codebook per projection (so the
  export stores one scale per tensor) and, since all layers share the weights, one gamma per
  projection for the whole model.
* int8 activations: per token over the last dim (the contraction dim), so every row of a
  matmul has its own scale; that is token-local, which keeps chunked, recurrent and TBPTT
  execution equal to the dense one. `int8_tensor_mean` uses one scale for the
  whole tensor and so depends on how a sequence is split into calls.

Training modes:
* qat_ste: fake quantization; value lerp(x, q, lambda), gradient as if the quantizer were
  the identity (straight-through estimator).
* train_kernel: the forward value comes from an integer matmul of the codes (int8 x ternary
  accumulated in int32, then rescaled), the gradient is the fake-quant one (the value of
  `reference + native - native.detach()`, done in one autograd Function so the float reference
  is never computed in forward). While lambda < 1 the operands are not integers, so the
  forward falls back to the float reference value.
* saved_activations = quantized_cache_recompute (train_kernel only): backward keeps the int8
  input codes and their scales instead of a float copy of the input, and re-dequantizes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import nn

from bdh_train.model.config import QuantConfig
from bdh_train.model.matmul import per_head_matmul, per_head_matmul_backward

EPS = 1e-5
"""Guards the scale divisions (BitNet's epsilon)."""

PROJECTION_TARGETS: Mapping[str, str] = MappingProxyType(
    {"encoder": "decoder_x", "encoder_v": "decoder_y", "decoder": "encoder"}
)
"""BDH projection (the `_project` name) -> paper target name used in `quant.target_modules`."""

TERNARY_FORMATS = ("ternary158", "ternary_threshold")


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """Scales are computed in float32 at least (bf16 means are too coarse), float64 if given."""
    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


# ------------------------------------------------------------------------------- quantizers
def quantize_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8, scale 0-d) with W_q = codes * scale; per-tensor scale.

    ternary158 (paper): gamma = mean|W|, codes = clamp(round(W / (gamma + eps)), -1, 1).
    ternary_threshold: codes = sign(W) where |W| >= gamma, else 0.
    int8: absmax per tensor, codes = clamp(round(W * 127 / absmax), -127, 127).
    """
    wf = w.detach().to(_compute_dtype(w))
    if fmt == "int8":
        scale = wf.abs().amax().clamp_min(EPS) / 127
        codes = (wf / scale).round().clamp(-127, 127)
    elif fmt == "ternary158":
        scale = wf.abs().mean()
        codes = (wf / (scale + EPS)).round().clamp(-1, 1)
    elif fmt == "ternary_threshold":
        scale = wf.abs().mean()
        codes = torch.sign(wf) * (wf.abs() >= scale)
    else:
        raise ValueError(f"unknown weight format {fmt!r}")
    return codes.to(torch.int8), scale


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.to(scale.dtype) * scale).to(dtype)


def fake_quant_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The quantized weight values W_q (no gradient)."""
    return dequantize_weight(*quantize_weight(w, fmt), w.dtype)


def quantize_activation(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8, s) with x_q = codes / s.

    int8 (paper): per token over the last dim, s = 127 / max(|x|, eps); codes in [-127, 127].
    int8_tensor_mean: one step 2 mean|x| / 127 for the whole tensor, i.e.
    s = 127 / max(2 mean|x|, eps); codes clamped to [-128, 127].
    """
    xf = x.detach().to(_compute_dtype(x))
    if fmt == "int8":
        s = 127.0 / xf.abs().amax(dim=-1, keepdim=True).clamp_min(EPS)
    elif fmt == "int8_tensor_mean":
        s = 127.0 / (2.0 * xf.abs().mean()).clamp_min(EPS)
    else:
        raise ValueError(f"unknown activation format {fmt!r}")
    codes = (xf * s).round().clamp(-128, 127)
    return codes.to(torch.int8), s


def dequantize_activation(codes: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.to(s.dtype) / s).to(dtype)


def fake_quant_activation(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The quantized activation values x_q (no gradient)."""
    return dequantize_activation(*quantize_activation(x, fmt), x.dtype)


def ste(x: torch.Tensor, q: torch.Tensor, lam: float = 1.0) -> torch.Tensor:
    """Straight-through estimator with warm-up: value x + lam (q - x), gradient d/dx = 1.

    The value is torch.lerp, which is exactly x at lam = 0 and exactly q at lam = 1 (the
    textbook `x + (q - x).detach()` is only equal to q up to float rounding).
    """
    if lam == 0.0:
        return x
    value = torch.lerp(x.detach(), q.detach().to(x.dtype), float(lam))
    return value + (x - x.detach())


def warmup_lambda(step: int, warmup_steps: int) -> float:
    """lambda ramps linearly 0 -> 1 over warmup_steps (0 = fully quantized from step 0)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, max(0, int(step)) / warmup_steps)


# ------------------------------------------------------------------------------- integer matmul
def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] int8 @ [K, N] int8 -> [M, N] int32, exact."""
    try:
        return torch._int_mm(a.contiguous(), b.contiguous())
    except (RuntimeError, AttributeError):  # shape/device limits of the fused kernel
        if a.device.type == "cpu":
            return a.to(torch.int32) @ b.to(torch.int32)
        # float64 is exact for |sums| < 2**53, far beyond int8 x int8 accumulations
        return (a.to(torch.float64) @ b.to(torch.float64)).to(torch.int32)


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Integer `a @ b` with int32 accumulation for BDH's broadcast shapes.

    a [..., K] @ b [K, N]; or a [B, 1|H, T, K] @ b [H, K, N] -> [B, H, T, N].
    """
    k = a.shape[-1]
    if b.dim() == 2:
        out = _int_mm(a.reshape(-1, k), b)
        return out.reshape(*a.shape[:-1], b.shape[-1])
    heads, _, n = b.shape
    batch, a_heads, seq_len, _ = a.shape
    if a_heads == 1:  # fold the heads into the columns: one [B*T, K] @ [K, H*N] matmul
        out = _int_mm(a.reshape(-1, k), b.permute(1, 0, 2).reshape(k, heads * n))
        return out.view(batch, seq_len, heads, n).permute(0, 2, 1, 3)
    outs = [_int_mm(a[:, h].reshape(-1, k), b[h]).view(batch, seq_len, n) for h in range(heads)]
    return torch.stack(outs, dim=1)


def native_matmul(
    x_codes: torch.Tensor,
    s: torch.Tensor,
    w_codes: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(x_codes / s) @ (w_codes * scale) computed as an integer matmul, then rescaled."""
    acc = int_matmul(x_codes, w_codes).to(s.dtype)
    return (acc * (scale.to(s.dtype) / s)).to(dtype)


# ------------------------------------------------------------------------------- autograd
class _KernelProjection(torch.autograd.Function):
    """train_kernel: native integer forward, fake-quant (STE) gradients.

    Saves either the float effective operands (saved_activations = none) or the int8 input codes
    with their scales plus the weight parameter itself (quantized_cache_recompute; the parameter
    is alive anyway, so saving it costs no memory, and the weight codes are recomputed).
    """

    @staticmethod
    def forward(ctx, x, w, weight_format, act_format, lam, recompute):
        x_codes, s = quantize_activation(x, act_format)
        w_codes, scale = quantize_weight(w, weight_format)
        x_q = dequantize_activation(x_codes, s, x.dtype)
        w_q = dequantize_weight(w_codes, scale, w.dtype)
        if lam >= 1.0:
            x_eff, w_eff = x_q, w_q
            out = native_matmul(x_codes, s, w_codes, scale, x.dtype)
        else:  # warm-up: the operands are blends, not integers; use the reference value
            x_eff, w_eff = torch.lerp(x, x_q, lam), torch.lerp(w, w_q, lam)
            out = per_head_matmul(x_eff, w_eff)
        ctx.lam, ctx.weight_format, ctx.recompute = lam, weight_format, recompute
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        if recompute:
            ctx.save_for_backward(x_codes, s, w)
        else:
            ctx.save_for_backward(x_eff, w_eff)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.recompute:
            x_codes, s, w = ctx.saved_tensors
            # exact x_eff when lam = 1; during warm-up it differs by <= (1 - lam) * step / 2
            x_eff = dequantize_activation(x_codes, s, ctx.x_dtype)
            w_eff = torch.lerp(w, fake_quant_weight(w, ctx.weight_format), ctx.lam)
        else:
            x_eff, w_eff = ctx.saved_tensors
        # one dtype for the products (autocast may hand us bf16 grads with fp32 weights)
        dtype = torch.promote_types(x_eff.dtype, w_eff.dtype)
        g = grad_out.to(dtype)
        grad_x, grad_w = per_head_matmul_backward(x_eff.to(dtype), w_eff.to(dtype), g)
        return grad_x.to(ctx.x_dtype), grad_w.to(w_eff.dtype), None, None, None, None


def quantized_projection(
    x: torch.Tensor,
    w: torch.Tensor,
    cfg: QuantConfig,
    lam: float = 1.0,
) -> torch.Tensor:
    """x @ w with x activation-quantized and w weight-quantized, per `cfg`."""
    if lam == 0.0:
        return per_head_matmul(x, w)  # the float model, exactly
    if cfg.training_mode == "qat_ste":
        x_q = ste(x, fake_quant_activation(x, cfg.act_format), lam)
        w_q = ste(w, fake_quant_weight(w, cfg.weight_format), lam)
        return per_head_matmul(x_q, w_q)
    recompute = cfg.saved_activations == "quantized_cache_recompute"
    return _KernelProjection.apply(x, w, cfg.weight_format, cfg.act_format, float(lam), recompute)


# ------------------------------------------------------------------------------- the module
class LowBitQuantizer(nn.Module):
    """Quantizes BDH's targeted projections; holds the warm-up step and frozen (exported) codes.

    No parameters and nothing persistent, so a quantized model's state_dict equals the float
    one's. The warm-up step is a plain attribute: the trainer sets it every step via
    `BDH.set_quant_step` (also after resuming). Frozen codes (from `load_ternary`) are
    non-persistent buffers so `.to(device)` moves them.
    """

    def __init__(self, cfg: QuantConfig):
        super().__init__()
        self.cfg = cfg
        self.targets = frozenset(cfg.target_modules)
        self.step = 0
        self._frozen: set[str] = set()

    def set_step(self, step: int) -> None:
        self.step = int(step)

    @property
    def lam(self) -> float:
        return warmup_lambda(self.step, self.cfg.warmup_steps)

    def applies_to(self, name: str) -> bool:
        """Whether BDH projection `name` ('encoder', 'encoder_v', 'decoder') is targeted."""
        return PROJECTION_TARGETS[name] in self.targets

    def freeze_weight(self, name: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """Use these integer codes and scale for `name` instead of quantizing its parameter.

        Re-quantizing already-ternary values would change gamma (mean|W_q| != gamma), so an
        exported model must run from its stored codes. Inference only: no weight gradient.
        """
        self.register_buffer(f"{name}_codes", codes.to(torch.int8), persistent=False)
        self.register_buffer(f"{name}_scale", scale.reshape(()), persistent=False)
        self._frozen.add(name)

    def quantized_weight(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """The values projection `name` multiplies by at lambda = 1: its frozen codes * scale,
        else its parameter `w` quantized (what a float export of the quantized model holds)."""
        if name in self._frozen:
            codes, scale = getattr(self, f"{name}_codes"), getattr(self, f"{name}_scale")
            return dequantize_weight(codes, scale, w.dtype)
        return fake_quant_weight(w, self.cfg.weight_format)

    def project(self, name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if name in self._frozen:
            codes, scale = getattr(self, f"{name}_codes"), getattr(self, f"{name}_scale")
            x_codes, s = quantize_activation(x, self.cfg.act_format)
            return native_matmul(x_codes, s, codes, scale.to(s.dtype), x.dtype)
        return quantized_projection(x, w, self.cfg, self.lam)

    def extra_repr(self) -> str:
        c = self.cfg
        return (
            f"weights={c.weight_format}, acts={c.act_format}, targets={sorted(self.targets)}, "
            f"mode={c.training_mode}, saved={c.saved_activations}, lambda={self.lam:g}"
        )
