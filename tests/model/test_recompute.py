"""Recomputation ('layer', 'mixer') against keeping every activation ('none'): the same losses,
parameter gradients and incoming-state gradients (fp64, 1e-10), and fewer saved tensors."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers import assert_close, tiny_model

from bdh_train.batch import SequenceBatch
from bdh_train.distributed.planner import build_pipeline_plan
from bdh_train.model import QuantConfig
from bdh_train.model.bdh import RECOMPUTE_MODES
from bdh_train.train.step import LanguageTrainModel

RECOMPUTING = [mode for mode in RECOMPUTE_MODES if mode != "none"]
RTOL = 1e-10

MODELS = {
    "plain": {},
    "dropout": {"dropout": 0.3},
    "qat-ste-warmup": {"quant": QuantConfig(enable=True, warmup_steps=4)},
    "qat-kernel-cache": {
        "quant": QuantConfig(
            enable=True, training_mode="train_kernel", saved_activations="quantized_cache_recompute"
        )
    },
    "alibi-learned-chunked": {"position": "alibi_learned", "executor": "chunked"},
    "resets": {},
    "token-shift-dropout-resets": {"token_shift": True, "dropout": 0.3},
}
"""Tiny fp64 model variants (tiny_config overrides); a case named with 'resets' adds a
document-reset mask."""


def _carried_state_gradients(mode: str, case: str):
    """Two calls continuing a random incoming state (leaves that require grad), the second
    from the first's state; the loss also reads the final state, so gradients flow into the
    layers' new rho as well as out of the incoming one. -> (loss, parameter and incoming-rho
    gradients)."""
    model = tiny_model(torch.float64, seed=1, **MODELS[case])
    model.set_recompute(mode)
    model.set_quant_step(1)  # lambda 1/4 under warm-up: the operands are blends
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 32, (2, 10), generator=g)
    targets = torch.randint(0, 32, (2, 10), generator=g)
    resets = None
    if "resets" in case:  # row 0 inside the first call, row 1 at the second call's start
        resets = torch.zeros(2, 10, dtype=torch.bool)
        resets[0, 3] = resets[1, 6] = True
    c = model.config
    state = model.init_state(2)
    state.rho = [
        torch.randn(2, c.n_head, c.n_neurons, c.n_embd, dtype=torch.float64, generator=g)
        .mul_(0.1)
        .requires_grad_()
        for _ in range(c.n_layer)
    ]
    state.position = torch.tensor([5, 2])
    incoming = list(state.rho)
    torch.manual_seed(3)  # the dropout draws
    hidden = [
        model.forward_hidden(
            idx[:, a:b], state, reset_mask=None if resets is None else resets[:, a:b]
        )
        for a, b in ((0, 6), (6, 10))
    ]
    loss = model.loss_from_hidden(torch.cat(hidden, dim=1), targets)
    loss = loss + sum(rho.square().mean() for rho in state.rho)
    names = [n for n, _ in model.named_parameters()]
    names += [f"incoming rho {layer}" for layer in range(len(incoming))]
    grads = torch.autograd.grad(loss, [*model.parameters(), *incoming], allow_unused=True)
    named = dict(zip(names, grads, strict=True))
    return loss.detach(), {n: g for n, g in named.items() if g is not None}


@pytest.mark.parametrize("case", list(MODELS))
@pytest.mark.parametrize("mode", RECOMPUTING)
def test_recompute_gradients_equal_keeping_everything(mode, case):
    loss, grads = _carried_state_gradients("none", case)
    assert len(grads) == sum(1 for _ in tiny_model(**MODELS[case]).parameters()) + 2
    recomputed_loss, recomputed = _carried_state_gradients(mode, case)
    assert_close(recomputed_loss, loss, rtol=RTOL, msg="loss")
    assert_close(recomputed, grads, rtol=RTOL, msg="gradients")


def _train_steps(mode: str, setting: str):
    """Two train steps of a dropout model: streaming TBPTT (chunks of 3, two per backward, a
    reset mid-chunk) or an emulated two-stage pipeline -> per step (loss, gradients) and the
    carried state's rho."""
    model = tiny_model(torch.float64, seed=4, dropout=0.2)
    model.set_recompute(mode)
    if setting == "tbptt":
        step = LanguageTrainModel(
            model, tbptt_chunk_size=3, tbptt_backprop_chunks=2, streaming=True
        )
    else:
        step = LanguageTrainModel(model, pipeline_plan=build_pipeline_plan(2, 2, 1, 2, "gpipe"))
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(6)
    out = []
    for _ in range(2):
        tokens = torch.randint(0, 32, (2, 9), generator=g)
        resets = None
        if setting == "tbptt":
            resets = torch.zeros(2, 8, dtype=torch.bool)
            resets[1, 4] = True
        batch = SequenceBatch(tokens[:, :-1], tokens[:, 1:], reset=resets)
        loss = step.train_step(batch).loss
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((loss, grads))
    carried = [] if step.carried_state is None else step.carried_state.rho
    return out, carried


@pytest.mark.parametrize("setting", ["tbptt", "pipeline"])
@pytest.mark.parametrize("mode", RECOMPUTING)
def test_recompute_train_steps_equal_keeping_everything(mode, setting):
    expected, expected_state = _train_steps("none", setting)
    steps, state = _train_steps(mode, setting)
    for i, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(steps, expected, strict=True)):
        assert_close(loss, want_loss, rtol=1e-7, msg=f"step {i} loss (float32)")
        assert_close(grads, want_grads, rtol=RTOL, msg=f"step {i} gradients")
    assert len(state) == len(expected_state) == (2 if setting == "tbptt" else 0)
    for layer, (rho, want) in enumerate(zip(state, expected_state, strict=True)):
        assert_close(rho, want, rtol=RTOL, msg=f"carried rho {layer}")


def _saved_bytes(mode: str) -> int:
    """Bytes of the tensors autograd keeps for backward outside any recomputed region (a
    checkpoint's own hooks take the ones inside) in one forward of a T=16 dense model."""
    model = tiny_model(seed=0, executor="dense")
    model.set_recompute(mode)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.forward_hidden(idx)
    return sum(saved)


def test_recompute_keeps_fewer_activations():
    none, layer, mixer = (_saved_bytes(mode) for mode in ("none", "layer", "mixer"))
    assert layer < mixer < none


@pytest.mark.parametrize(
    ("mode", "method", "runs_in_training"),
    [
        ("layer", "layer_step", 2),
        ("mixer", "mix", 2),
        ("none", "layer_step", 1),
        ("none", "mix", 1),
    ],
)
def test_recompute_runs_again_only_in_a_training_backward(mode, method, runs_in_training):
    """Calls per layer: the recomputed part runs twice in a training forward+backward, once in
    evaluation mode and once without gradients (training mode)."""
    model = tiny_model(n_layer=3)
    model.set_recompute(mode)
    idx = torch.randint(0, 32, (1, 5))
    calls = []
    original = getattr(model, method)
    with mock.patch.object(model, method, side_effect=lambda *a: calls.append(1) or original(*a)):
        model.train()
        model.forward_hidden(idx).sum().backward()
        trained = len(calls)
        model.eval()
        model.forward_hidden(idx).sum().backward()
        model.train()
        with torch.no_grad():
            model.forward_hidden(idx)
    assert (trained, len(calls) - trained) == (3 * runs_in_training, 6)


def test_unknown_recompute_mode_is_refused():
    with pytest.raises(ValueError, match=r"unknown recompute mode 'all'; expected one of"):
        tiny_model().set_recompute("all")
