"""model.token_shift: the encoder reads u_t + u_{t-1}. The shifted input against a hand-built
case; a call split anywhere, token by token, or with documents starting inside it equals one
call; the first token of a document is the plain model's; generation and the carried state."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, tiny_model

from bdh_train.model import sampling
from bdh_train.model.bdh import previous_tokens
from bdh_train.model.decoders import GenericDecoder

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def test_previous_tokens_by_hand():
    """u [2, 1, 4, 1] holds 10*row + t; row 0 continues from a carried 7, row 1 is fresh
    there but starts a document at t = 2."""
    u = (torch.arange(4.0) + torch.tensor([[0.0], [10.0]])).view(2, 1, 4, 1)
    last = torch.tensor([7.0, 0.0]).view(2, 1, 1, 1)
    assert previous_tokens(u, last).flatten().tolist() == [7, 0, 1, 2, 0, 10, 11, 12]
    assert previous_tokens(u, None).flatten().tolist() == [0, 0, 1, 2, 0, 10, 11, 12]
    resets = torch.tensor([[False, False, False, False], [False, False, True, False]])
    got = previous_tokens(u, last, resets).flatten().tolist()
    assert got == [7, 0, 1, 2, 0, 10, 0, 12]
    resets[0, 0] = True  # a document starting at the call's first token drops the carried u
    assert previous_tokens(u, last, resets).flatten().tolist()[:2] == [0, 0]


def _model(dtype: torch.dtype, position: str, **overrides):
    return tiny_model(dtype, position=position, token_shift=True, **overrides).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_split_calls_and_token_steps_equal_one_call(dtype, position):
    model = _model(dtype, position)
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole_state = model.init_state(2)
        whole = model.forward_hidden(idx, whole_state)
        for splits in ([3, 5, 8], [1] * 16):
            state, pieces, start = model.init_state(2), [], 0
            for size in splits:
                executor = "recurrent" if size == 1 else None
                pieces.append(model.forward_hidden(idx[:, start : start + size], state, executor))
                start += size
            assert_close(torch.cat(pieces, dim=1), whole, rtol=TOLERANCE[dtype])
            for got, want in zip(state.previous, whole_state.previous, strict=True):
                assert_close(got, want, rtol=TOLERANCE[dtype])
    # the carried input is the layer's input at the last token: layer 0's is the embedding
    assert torch.equal(whole_state.previous[0], model.embed_tokens(idx[:, -1:]).unsqueeze(1))


def test_the_shift_changes_every_token_but_a_documents_first():
    """Same weights with and without the shift: a document's first token reads zeros as its
    previous token (and nothing from the state), so it is the plain model's; the rest differ."""
    shifted = _model(torch.float64, "rope")
    plain = tiny_model(torch.float64, position="rope").eval()
    plain.load_state_dict(shifted.state_dict())
    idx = torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = shifted.forward_hidden(idx), plain.forward_hidden(idx)
    assert_close(a[:, 0], b[:, 0], rtol=1e-12)
    assert ((a[:, 1:] - b[:, 1:]).abs().amax(-1) > 1e-3).all()


@pytest.mark.parametrize("executor", ["auto", "chunked"])
def test_documents_starting_inside_a_call_equal_separate_calls(executor):
    """Row 0 starts a document at token 5 of a call that continues a carried state; row 1 at
    the call's first token. Each document equals the model reading it alone, fresh."""
    model = _model(torch.float64, "alibi", executor=executor)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 32, (2, 4), generator=gen)
    idx = torch.randint(0, 32, (2, 12), generator=gen)
    resets = torch.zeros(2, 12, dtype=torch.bool)
    resets[0, 5] = resets[1, 0] = True
    with torch.no_grad():
        state = model.init_state(2)
        model.forward_hidden(prefix, state)
        both = model.forward_hidden(idx, state, reset_mask=resets)
        alone = [model.forward_hidden(idx[:1, 5:]), model.forward_hidden(idx[1:])]
        before = model.forward_hidden(torch.cat([prefix[:1], idx[:1, :5]], dim=1))[:, 4:]
    assert_close(both[:1, 5:], alone[0], rtol=1e-10)
    assert_close(both[1:], alone[1], rtol=1e-10)
    assert_close(both[:1, :5], before, rtol=1e-10)


def test_generation_carries_the_shift_through_the_generic_decoder():
    """Teacher-forced steps from rows read alone (prompts of 5 and 2 tokens, joined with
    ModelState.concat) equal the whole forward; batch generation equals each row alone,
    with a stop token dropping a row (select_rows_)."""
    model = _model(torch.float64, "rope")
    seq = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(6))
    starts = (5, 2)
    with torch.no_grad():
        states = []
        for b, start in enumerate(starts):
            states.append(model.init_state(1))
            model.forward_hidden(seq[b : b + 1, :start], states[-1])
        decoder = GenericDecoder(model, type(states[0]).concat(states))
        for step in range(6):
            tokens = torch.stack([seq[b, start + step] for b, start in enumerate(starts)])
            got = model.logits_from_hidden(decoder.step(tokens))
            for b, start in enumerate(starts):
                want = model(seq[b : b + 1, : start + step + 1])[0][0, -1]
                assert_close(got[b], want, rtol=1e-10, msg=f"row {b}, step {step}")
    prompts = [[3, 1, 4], [1], [5, 9, 2, 6]]
    alone = [sampling.generate(model, torch.tensor(p), 6, temperature=0) for p in prompts]
    stop = int(alone[1][2])
    batch = sampling.generate_batch(model, prompts, 6, temperature=0, stop_tokens=[stop])
    for row, (prompt, tokens) in enumerate(zip(prompts, alone, strict=True)):
        new = tokens[len(prompt) :].tolist()
        cut = new[: new.index(stop) + 1] if stop in new else new
        assert batch[row].tolist() == prompt + cut, f"row {row}"


def test_gradients_reach_the_carried_input_until_detached():
    """TBPTT: a second call's output depends on the first call's tokens through the carried
    u (rho zeroed, so the shift is the only path), until `detach_` cuts it, as it does rho."""
    model = tiny_model(torch.float64, token_shift=True).train()
    idx = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(7))

    def second_call_gradient(detach: bool) -> torch.Tensor | None:
        u = model.embed_tokens(idx[:, :4]).detach().requires_grad_()
        state = model.init_state(1)
        model.forward_hidden(idx[:, :4], state, u=u)
        state.rho = [torch.zeros_like(r).detach() for r in state.rho]
        if detach:
            state.detach_()
        # two tokens: x reaches the output only through the next token's read of the state
        hidden = model.forward_hidden(idx[:, 4:6], state)  # normed: its square sums to D
        out = (hidden * torch.linspace(-1, 1, hidden.shape[-1], dtype=hidden.dtype)).sum()
        return torch.autograd.grad(out, u, allow_unused=True)[0]

    carried = second_call_gradient(detach=False)
    assert carried is not None and carried[:, -1].abs().sum() > 0  # layer 0 reads u at token 3
    assert second_call_gradient(detach=True) is None


def test_a_document_starting_at_the_calls_first_token_drops_the_carried_input():
    """Every row starting a document at the call's first token (the path where the state is
    reset before the layers run, not masked inside them): the call equals reading it fresh."""
    model = _model(torch.float64, "rope")
    gen = torch.Generator().manual_seed(8)
    prefix = torch.randint(0, 32, (2, 5), generator=gen)
    idx = torch.randint(0, 32, (2, 6), generator=gen)
    resets = torch.zeros(2, 6, dtype=torch.bool)
    resets[:, 0] = True
    with torch.no_grad():
        state = model.init_state(2)
        model.forward_hidden(prefix, state)
        got = model.forward_hidden(idx, state, reset_mask=resets)
        want = model.forward_hidden(idx)
    assert_close(got, want, rtol=1e-10)
