"""BitNet b1.58 QAT: quantizers, STE, integer kernel, int8 saved activations, lambda
warm-up, a short training run, config validation and the ternary export."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_model

from bdh_train.errors import CheckpointError, ConfigError
from bdh_train.export.ternary import export_ternary
from bdh_train.model import BDH, BDHConfig, QuantConfig
from bdh_train.model.matmul import per_head_matmul
from bdh_train.model.mixer import EXECUTORS
from bdh_train.model.quant import (
    fake_quant_activation,
    fake_quant_weight,
    int_matmul,
    quantize_activation,
    quantize_weight,
    quantized_projection,
    ste,
    warmup_lambda,
)
from bdh_train.storage.ternary import load_ternary, pack_ternary, unpack_ternary

# BDH's three projection shapes: u @ encoder, a @ encoder_v, y @ decoder (B=2, T=5, H=3, D=8, N=6)
SHAPES = [((2, 1, 5, 8), (3, 8, 6)), ((2, 3, 5, 8), (3, 8, 6)), ((2, 1, 5, 18), (18, 8))]


def qcfg(**kw) -> QuantConfig:
    return QuantConfig(enable=True, **kw)


def qmodel(dtype=torch.float32, seed=0, **quant) -> BDH:
    return tiny_model(dtype, seed, quant=qcfg(**quant))


# ------------------------------------------------------------------------------ quantizers
def test_paper_and_threshold_ternary_rules_on_a_hand_example():
    w = torch.tensor([0.1, 0.4, -0.6, 1.0])
    codes, gamma = quantize_weight(w, "ternary158")
    assert gamma.item() == pytest.approx(0.525)
    # W / gamma = [0.19, 0.76, -1.14, 1.90] -> round, clamp to [-1, 1]
    assert codes.tolist() == [0, 1, -1, 1]
    codes, gamma = quantize_weight(w, "ternary_threshold")
    assert gamma.item() == pytest.approx(0.525)
    assert codes.tolist() == [0, 0, -1, 1]  # only |W| >= gamma survives
    g = gamma.item()
    assert fake_quant_weight(w, "ternary158").tolist() == pytest.approx([0, g, -g, g])
    codes, scale = quantize_weight(torch.tensor([0.5, -1.0, 0.25]), "int8")
    assert codes.tolist() == [64, -127, 32] and scale.item() == pytest.approx(1 / 127)


@pytest.mark.parametrize("fmt", ["ternary158", "ternary_threshold"])
def test_ternary_weights_take_exactly_three_values(fmt):
    w = torch.randn(3, 16, 24)
    wq = fake_quant_weight(w, fmt)
    gamma = w.abs().mean()
    assert set(wq.unique().tolist()) == {-gamma.item(), 0.0, gamma.item()}


def test_int8_activation_rules_on_hand_examples():
    codes, s = quantize_activation(torch.tensor([[0.5, -1.0, 0.25], [2.0, 1.0, 0.0]]), "int8")
    assert codes.tolist() == [[64, -127, 32], [127, 64, 0]]  # per token: absmax -> 127
    assert s.flatten().tolist() == pytest.approx([127.0, 63.5])
    # int8_tensor_mean: one step 2 mean|x| / 127 = 4/127 for the whole tensor
    codes, s = quantize_activation(torch.tensor([1.0, -2.0, 3.0, -2.0]), "int8_tensor_mean")
    assert s.item() == pytest.approx(127 / 4)
    assert codes.tolist() == [32, -64, 95, -64]
    big = torch.tensor([100.0, 0.1, 0.1, 0.1])
    assert quantize_activation(big, "int8_tensor_mean")[0].max().item() == 127  # clamped


def test_int8_activations_have_at_most_255_levels_per_token():
    x = torch.randn(4, 7, 1000) * torch.rand(4, 7, 1) * 10
    xq = fake_quant_activation(x, "int8")
    codes, s = quantize_activation(x, "int8")
    assert codes.min() >= -127 and codes.max() <= 127
    assert max(len(row.unique()) for row in xq.reshape(-1, 1000)) <= 255
    torch.testing.assert_close(xq, codes.float() / s)
    assert (xq - x).abs().max() <= (0.5 / s).max() * (1 + 1e-6)


def test_int_matmul_is_exact_for_bdh_shapes():
    g = torch.Generator().manual_seed(0)
    for xs, ws in SHAPES:
        a = torch.randint(-128, 128, xs, generator=g, dtype=torch.int8)
        b = torch.randint(-1, 2, ws, generator=g, dtype=torch.int8)
        assert torch.equal(int_matmul(a, b), (a.to(torch.int64) @ b.to(torch.int64)).int())


# ------------------------------------------------------------------------------ STE
def test_ste_value_and_gradient():
    x = torch.tensor([0.3, -1.2, 2.0], requires_grad=True)
    q = torch.tensor([0.0, -1.0, 2.5])
    assert torch.equal(ste(x, q, 1.0), q) and torch.equal(ste(x, q, 0.0), x)
    out = ste(x, q, 0.25)
    assert out.tolist() == pytest.approx((x + 0.25 * (q - x)).tolist())
    (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert x.grad.tolist() == [1.0, 2.0, 3.0]  # the quantizer is the identity in backward


@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_qat_ste_projection_gradient_matches_hand_written(lam):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 3, 4, generator=g, requires_grad=True)
    w = torch.randn(4, 5, generator=g, requires_grad=True)
    upstream = torch.randn(1, 1, 3, 5, generator=g)
    out = quantized_projection(x, w, qcfg(), lam)
    out.backward(upstream)
    xq, wq = fake_quant_activation(x, "int8"), fake_quant_weight(w, "ternary158")
    x_eff, w_eff = x + lam * (xq - x), w + lam * (wq - w)
    torch.testing.assert_close(out, x_eff @ w_eff)
    # d(loss)/dx = upstream @ w_effᵀ and d(loss)/dw = x_effᵀ @ upstream (straight-through)
    torch.testing.assert_close(x.grad, upstream @ w_eff.detach().T)
    torch.testing.assert_close(w.grad, x_eff.detach()[0, 0].T @ upstream[0, 0])


class _IdentityBackward(torch.autograd.Function):
    """Forward: the quantized value; backward: identity. An independent STE."""

    @staticmethod
    def forward(ctx, x, q):
        return q.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ManualSTE(BDH):
    def _project(self, name, inputs, weight):
        xq = _IdentityBackward.apply(inputs, fake_quant_activation(inputs, "int8"))
        wq = _IdentityBackward.apply(weight, fake_quant_weight(weight, "ternary158"))
        return per_head_matmul(xq, wq)  # the float model's product, so only the STE differs


def test_quantized_model_gradients_equal_identity_backward_graph():
    model = qmodel(torch.float64)
    manual = _ManualSTE(model.config).to(torch.float64)
    manual.load_state_dict(model.state_dict())
    idx, tgt = torch.randint(0, 32, (2, 9)), torch.randint(0, 32, (2, 9))
    losses = []
    for m in (model, manual):
        loss = m(idx, tgt)[1]
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), manual.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)


# ------------------------------------------------------------------------------ train kernel
def _projection_grads(x0, w0, cfg, lam, upstream=None):
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    out = quantized_projection(x, w, cfg, lam)
    upstream = torch.randn_like(out) if upstream is None else upstream
    out.backward(upstream)
    return out.detach(), x.grad, w.grad, upstream


@pytest.mark.parametrize(("xs", "ws"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_train_kernel_forward_and_gradients_equal_fake_quant(xs, ws, dtype):
    """Forward to 1e-5; grad_x identical; grad_w equal up to summation order (the kernel sums
    over B*T in one matmul instead of per-batch matmuls: a float32 ulp, 1e-7 in float64)."""
    x, w = torch.randn(xs, dtype=dtype), torch.randn(ws, dtype=dtype) * 0.02
    ref, gx, gw, up = _projection_grads(x, w, qcfg(), 1.0)
    out, kx, kw, _ = _projection_grads(x, w, qcfg(training_mode="train_kernel"), 1.0, up)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(kx, gx)  # same formula, same operands
    ulp = torch.finfo(dtype).eps * gw.abs().max().item()
    assert (kw - gw).abs().max() <= (2 * ulp if dtype == torch.float32 else 1e-7)


def test_train_kernel_model_matches_fake_quant_model():
    """Whole model. Logits agree to 1e-5. Gradients are identical where no ReLU sits on a
    quantized projection's output (target 'encoder' = y @ decoder): the integer kernel gives
    exact zeros where float fake-quant gives +-1e-17, and relu'(0) = 0 flips the mask there, so
    with decoder_x / decoder_y targeted the two gradients differ at those ties only."""
    idx, tgt = torch.randint(0, 32, (2, 9)), torch.randint(0, 32, (2, 9))
    for targets in (["decoder_x", "decoder_y", "encoder"], ["encoder"]):
        runs = []
        for mode in ("qat_ste", "train_kernel"):
            model = qmodel(torch.float64, target_modules=targets, training_mode=mode)
            logits, loss = model(idx, tgt)
            loss.backward()
            runs.append((logits.detach(), [p.grad for p in model.parameters()]))
        torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=1e-5)
        if targets == ["encoder"]:
            for a, b in zip(runs[0][1], runs[1][1], strict=True):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("xs", "ws"), SHAPES)
@pytest.mark.parametrize("lam", [1.0, 0.4])
def test_quantized_cache_recompute_gradients(xs, ws, lam):
    """Equal to the float-saved gradients up to the int8 rounding of the saved input: backward
    uses x_q where the float path uses x + lam (x_q - x), an error of (1 - lam) |x - x_q| <=
    (1 - lam) / (2 s) per element, so |d grad_w| <= (1 - lam) * sum_rows |upstream| / (2 s)."""
    x, w = torch.randn(xs, dtype=torch.float64), torch.randn(ws, dtype=torch.float64) * 0.02
    kernel = qcfg(training_mode="train_kernel")
    cache = qcfg(training_mode="train_kernel", saved_activations="quantized_cache_recompute")
    ref, gx, gw, up = _projection_grads(x, w, kernel, lam)
    out, cx, cw, _ = _projection_grads(x, w, cache, lam, up)
    assert torch.equal(out, ref) and torch.equal(cx, gx)
    _, s = quantize_activation(x, "int8")
    half_step = (0.5 / s).expand(xs)  # per element
    rows_x = half_step.transpose(0, 1).reshape(xs[1], -1, xs[-1])  # [1|H, B*T, K]
    rows_g = up.abs().transpose(0, 1).reshape(up.shape[1], -1, up.shape[-1])  # [H, B*T, N]
    bound = (1 - lam) * (rows_x.mT @ rows_g).reshape(ws) + 1e-12
    assert ((cw - gw).abs() <= bound).all()
    if lam == 1.0:
        torch.testing.assert_close(cw, gw, rtol=0, atol=1e-15)


def test_quantized_cache_recompute_model_gradients_equal_train_kernel():
    idx, tgt = torch.randint(0, 32, (2, 9)), torch.randint(0, 32, (2, 9))
    grads = []
    for saved in ("none", "quantized_cache_recompute"):
        model = qmodel(training_mode="train_kernel", saved_activations=saved)
        model(idx, tgt)[1].backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7)


def _saved(fn) -> tuple[int, set[torch.dtype]]:
    """Bytes and dtypes of the non-parameter tensors autograd saves while fn() runs."""
    sizes, dtypes = {}, set()

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            dtypes.add(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes.values()), dtypes


def test_quantized_cache_saves_int8_codes_not_floats():
    """The memory claim of benchmarks/bench_quant_memory.py on small shapes: <= 30%."""
    shapes = [
        ((2, 1, 16, 64), (4, 64, 32)),
        ((2, 4, 16, 64), (4, 64, 32)),
        ((2, 1, 16, 128), (128, 64)),
    ]
    kernel = qcfg(training_mode="train_kernel")
    cache = qcfg(training_mode="train_kernel", saved_activations="quantized_cache_recompute")
    for xs, ws in shapes:
        x, w = torch.randn(xs, requires_grad=True), torch.nn.Parameter(torch.randn(ws))
        float_bytes, _ = _saved(lambda x=x, w=w: x @ w)
        kernel_bytes, _ = _saved(lambda x=x, w=w: quantized_projection(x, w, kernel))
        cache_bytes, dtypes = _saved(lambda x=x, w=w: quantized_projection(x, w, cache))
        assert torch.int8 in dtypes
        assert cache_bytes <= 0.3 * kernel_bytes and cache_bytes <= 0.3 * float_bytes


# ------------------------------------------------------------------------------ lambda warm-up
def _quantized_reference(model: BDH, idx: torch.Tensor) -> torch.Tensor:
    """fp64 BDH forward (rope) with the BitNet b1.58 quantizers written out by hand."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    enc, enc_v, dec, emb, head = (
        sd[k] for k in ("encoder", "encoder_v", "decoder", "embed.weight", "lm_head")
    )

    def ternary(w):
        gamma = w.abs().mean()
        return (w / (gamma + 1e-5)).round().clamp(-1, 1) * gamma

    def act(x):
        s = 127 / x.abs().amax(-1, keepdim=True).clamp_min(1e-5)
        return (x * s).round().clamp(-128, 127) / s

    def ln(z):
        return torch.nn.functional.layer_norm(z, z.shape[-1:], eps=1e-5)

    from bdh_train.model.positions import apply_rope, rope_cos_sin

    b, t = idx.shape
    h, d, n = enc.shape
    u = ln(emb[idx]).view(b, 1, t, d)
    cos_sin = rope_cos_sin(torch.arange(t).expand(b, t), n, torch.float64)
    for _ in range(model.config.n_layer):
        x = torch.relu(act(u) @ ternary(enc))
        q = apply_rope(x, *cos_sin)
        scores = (q @ q.mT).tril(diagonal=-1)
        a = ln(scores @ u)
        y = x * torch.relu(act(a) @ ternary(enc_v))
        y = y.transpose(1, 2).reshape(b, 1, t, h * n)
        u = ln(u + ln(act(y) @ ternary(dec)))
    return u.view(b, t, d) @ head


def test_lambda_warmup_zero_is_float_one_is_full_quantization():
    idx = torch.randint(0, 32, (2, 7))
    float_logits = tiny_model(torch.float64)(idx)[0]
    model = qmodel(torch.float64, warmup_steps=10)
    assert torch.equal(model(idx)[0], float_logits)  # step 0: lambda = 0
    model.set_quant_step(5)
    half = model(idx)[0]
    model.set_quant_step(10)
    full = model(idx)[0]
    torch.testing.assert_close(full, qmodel(torch.float64)(idx)[0], rtol=0, atol=0)
    torch.testing.assert_close(full, _quantized_reference(model, idx), rtol=0, atol=1e-9)
    assert not torch.allclose(half, full) and not torch.allclose(half, float_logits)
    assert [warmup_lambda(s, 4) for s in (0, 1, 2, 4, 9)] == [0.0, 0.25, 0.5, 1.0, 1.0]
    assert warmup_lambda(0, 0) == 1.0


@pytest.mark.parametrize("mode", ["train_kernel", "qat_ste"])
def test_warmup_zero_is_exactly_float_in_every_mode(mode):
    idx, tgt = torch.randint(0, 32, (2, 7)), torch.randint(0, 32, (2, 7))
    ref = tiny_model()
    ref(idx, tgt)[1].backward()
    model = qmodel(training_mode=mode, warmup_steps=3)
    loss = model(idx, tgt)[1]
    loss.backward()
    assert torch.equal(loss, ref(idx, tgt)[1])
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("executor", [e for e in EXECUTORS if e != "dense"])
def test_per_token_quantization_keeps_executors_equal(executor):
    model = qmodel(torch.float64)
    idx = torch.randint(0, 32, (2, 11))
    dense = model.forward_hidden(idx, executor="dense")
    torch.testing.assert_close(
        model.forward_hidden(idx, executor=executor), dense, rtol=0, atol=1e-9
    )


# ------------------------------------------------------------------------------ training
@pytest.mark.parametrize(
    "quant",
    [
        {"warmup_steps": 5},
        {"training_mode": "train_kernel", "saved_activations": "quantized_cache_recompute"},
    ],
)
def test_twenty_quantized_steps_decrease_the_loss(quant):
    torch.manual_seed(0)
    text = b"the dragon hatchling learns to read. " * 8
    data = torch.tensor(list(text))
    cfg = BDHConfig(
        n_layer=2,
        n_embd=32,
        n_head=2,
        mlp_internal_dim_multiplier=4,
        vocab_size=256,
        dropout=0.0,
        quant=qcfg(**quant),
    )
    model = BDH(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    starts = torch.arange(0, len(data) - 33, 9)[:8]
    idx = torch.stack([data[s : s + 32] for s in starts])
    tgt = torch.stack([data[s + 1 : s + 33] for s in starts])
    losses = []
    for step in range(20):
        model.set_quant_step(step)
        loss = model(idx, tgt)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.75 * losses[0], losses


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"weight_format": "int4"}, "model.quant.weight_format must be one of"),
        ({"act_format": "fp8"}, "model.quant.act_format must be one of"),
        ({"target_modules": ["lm_head"]}, "model.quant.target_modules[] must be one of"),
        ({"target_modules": []}, "model.quant.target_modules must be a non-empty list"),
        ({"target_modules": ["encoder", "encoder"]}, "model.quant.target_modules lists"),
        ({"training_mode": "bf16"}, "model.quant.training_mode must be one of"),
        ({"saved_activations": "quantized_cache_recompute"}, "needs model.quant.training_mode"),
        ({"warmup_steps": -1}, "model.quant.warmup_steps must be a non-negative integer"),
    ],
)
def test_quant_config_errors_name_the_field(overrides, message):
    cfg = BDHConfig(quant=qcfg(**overrides))
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert message in str(err.value)


def test_int8_train_kernel_overflow_and_nca_head_are_rejected():
    big = BDHConfig(n_embd=64, n_head=4, mlp_internal_dim_multiplier=4096)
    big.quant = qcfg(weight_format="int8", training_mode="train_kernel")
    with pytest.raises(ConfigError, match="model.quant.weight_format='int8' with training_mode"):
        big.validate()
    big.quant = qcfg(weight_format="int8")  # fake quant has no int32 accumulator
    big.validate()
    BDHConfig(quant=qcfg(weight_format="int8", training_mode="train_kernel")).validate()
    nca = BDHConfig(vocab_size=19, quant=qcfg())
    nca.language_head.type = "nca_factorized_patch"
    nca.language_head.patch_size = 2
    nca.language_head.frame_special_tokens = True
    with pytest.raises(ConfigError, match="model.quant.enable=true is not supported with"):
        nca.validate()


@pytest.mark.parametrize("weight_format", ["int8", "ternary_threshold"])
def test_other_formats_train_in_kernel_mode(weight_format):
    idx, tgt = torch.randint(0, 32, (2, 6)), torch.randint(0, 32, (2, 6))
    ref = qmodel(weight_format=weight_format, act_format="int8_tensor_mean")
    ker = qmodel(
        weight_format=weight_format, act_format="int8_tensor_mean", training_mode="train_kernel"
    )
    torch.testing.assert_close(ker(idx)[0], ref(idx)[0], rtol=0, atol=1e-5)
    ker(idx, tgt)[1].backward()
    assert all(torch.isfinite(p.grad).all() for p in ker.parameters())


def test_state_dict_is_unchanged_by_quantization():
    assert list(qmodel().state_dict()) == list(tiny_model().state_dict())


# ------------------------------------------------------------------------------ export
@pytest.mark.parametrize("numel", [1, 3, 4, 5, 17, 4096])
def test_ternary_packing_round_trip_is_exact(numel):
    codes = torch.randint(-1, 2, (numel,), dtype=torch.int8)
    packed = pack_ternary(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel / 4)
    assert torch.equal(unpack_ternary(packed, (numel,)), codes)
    grid = torch.randint(-1, 2, (3, 5, 7), dtype=torch.int8)
    assert torch.equal(unpack_ternary(pack_ternary(grid), grid.shape), grid)
    # bit layout: element 4i + j sits in bits 2j..2j+1 of byte i, stored as code + 1
    assert pack_ternary(torch.tensor([-1, 0, 1, 1], dtype=torch.int8)).item() == 0 + 4 + 32 + 128


@pytest.mark.parametrize("fmt", ["ternary158", "ternary_threshold"])
def test_export_load_gives_the_fake_quant_logits(tmp_path, fmt):
    model = tiny_model(
        n_embd=32, mlp_internal_dim_multiplier=8, quant=qcfg(weight_format=fmt, warmup_steps=7)
    ).eval()
    model.set_quant_step(7)
    path = export_ternary(model, tmp_path / "m.safetensors")
    loaded = load_ternary(path)
    assert loaded.config == model.config and not loaded.training
    idx = torch.randint(0, 32, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], model(idx)[0], rtol=0, atol=1e-5)
        assert torch.equal(loaded.encoder, fake_quant_weight(model.encoder, fmt))
    # file size: the three ternary tensors take 1/16 of their float32 bytes
    ternary_float_bytes = sum(model.get_parameter(n).numel() * 4 for n in ("encoder", "encoder_v"))
    ternary_float_bytes += model.decoder.numel() * 4
    other_bytes = sum(
        p.numel() * 4 for n, p in model.named_parameters() if n in ("embed.weight", "lm_head")
    )
    size = path.stat().st_size
    assert size <= other_bytes + ternary_float_bytes / 16 + 4096  # + header, scales, padding
    assert size >= other_bytes + ternary_float_bytes / 16


def test_export_partial_targets_keeps_the_rest_float(tmp_path):
    model = qmodel(target_modules=["decoder_y"]).eval()
    loaded = load_ternary(export_ternary(model, tmp_path / "p.safetensors"))
    assert torch.equal(loaded.encoder, model.encoder) and torch.equal(loaded.decoder, model.decoder)
    idx = torch.randint(0, 32, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], model(idx)[0], rtol=0, atol=1e-5)


def test_export_rejects_float_and_int8_models(tmp_path):
    with pytest.raises(ConfigError, match="model.quant.enable = true"):
        export_ternary(tiny_model(), tmp_path / "f.safetensors")
    with pytest.raises(ConfigError, match="weight_format='int8'"):
        export_ternary(qmodel(weight_format="int8"), tmp_path / "i.safetensors")


def test_an_export_whose_config_does_not_fit_its_tensors_is_one_line(tmp_path):
    """A config edited to twice the heads: one line naming every tensor that does not fit
    (torch's own message is a line per tensor)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    path = export_ternary(qmodel(target_modules=["decoder_y"]).eval(), tmp_path / "m.safetensors")
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 (not a dict)
    config = json.loads(meta["config"])
    heads = config["n_head"]
    meta["config"] = json.dumps({**config, "n_head": 2 * heads})
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CheckpointError) as refused:
        load_ternary(path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"the config of the ternary export '{path}' does not fit its tensors (mismatched "
    )
    assert f"encoder: checkpoint [{heads}, " in message and f"vs model [{2 * heads}, " in message
    assert message.endswith("): the file was changed or damaged")
