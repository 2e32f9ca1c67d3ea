"""Summary memory: the model against a float64 token-by-token implementation of its formulas,
split calls against one call, generation, the carry in ModelState, and 'off' changing nothing."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close, tiny_model

from bdh_train.data.events import SummaryEventTrigger
from bdh_train.errors import CheckpointError, ConfigError
from bdh_train.model import BDHConfig, sampling
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.model.mixer import EXECUTORS
from bdh_train.model.sampling import sample_next_token
from bdh_train.model.summary import SummaryCarry, summary_branch

VOCAB = 32


def summary(**overrides) -> SummaryMemoryConfig:
    return SummaryMemoryConfig(**{"enabled": True, "chunk_tokens": 3, **overrides})


GATES = {
    "plain": {},
    "surprise": {"surprise_gate_threshold": 0.3, "surprise_gate_sharpness": 2.0},
    "write": {"write_gate": True},
    "both": {"write_gate": True, "surprise_gate_threshold": 0.3, "surprise_gate_sharpness": 2.0},
}


# ------------------------------------------------------------------ the reference
def reference(weights, idx, n_layer, position, sm: SummaryMemoryConfig, mask=None):
    """Logits [B, T, V] token by token, straight from the formulas: per enabled layer a
    running chunk sum, the memory added to the layer input, an update when a chunk of
    chunk_tokens (counted from position 0) completes."""
    enc, enc_v, dec = weights["encoder"], weights["encoder_v"], weights["decoder"]
    emb, head = weights["embed.weight"], weights["lm_head"]
    H, D, N = enc.shape
    B, T = idx.shape
    C = sm.chunk_tokens
    enabled = set(range(n_layer - (sm.last_layers or n_layer), n_layer)) if sm.enabled else set()

    def ln(z):
        mu = z.mean(-1, keepdim=True)
        return (z - mu) / torch.sqrt(((z - mu) ** 2).mean(-1, keepdim=True) + 1e-5)

    def rope(vec, p):
        i = torch.arange(N, dtype=torch.float64)
        phase = torch.frac(p / (2.0**16) ** (2 * torch.floor(i / 2) / N) / (2 * math.pi))
        rot = torch.empty_like(vec)
        rot[..., 0::2], rot[..., 1::2] = -vec[..., 1::2], vec[..., 0::2]
        return vec * torch.cos(phase * 2 * math.pi) + rot * torch.sin(phase * 2 * math.pi)

    decay = torch.exp(-(2.0 ** (-torch.arange(H, dtype=torch.float64) / H)))
    rho = [torch.zeros(B, H, N, D, dtype=torch.float64) for _ in range(n_layer)]
    memory = [None] * n_layer  # m_prev [B, D]; None = absent
    chunk_sum = [torch.zeros(B, D, dtype=torch.float64) for _ in range(n_layer)]
    chunk_hits = [torch.zeros(B, dtype=torch.float64) for _ in range(n_layer)]
    logits = torch.empty(B, T, head.shape[1], dtype=torch.float64)
    for t in range(T):
        u = ln(emb[idx[:, t]])
        for layer in range(n_layer):
            if layer in enabled:
                m_prev = memory[layer]
                chunk_sum[layer] = chunk_sum[layer] + u
                if mask is not None:
                    chunk_hits[layer] = chunk_hits[layer] + mask[:, t].double()
                branch = u if m_prev is None else u + sm.residual_scale * m_prev
                if (t + 1) % C == 0:  # this token completes its chunk: update m
                    s = chunk_sum[layer] / C
                    if m_prev is None:
                        updated = sm.state_update_scale * s
                    else:
                        updated = sm.state_decay * m_prev + sm.state_update_scale * s
                    if sm.surprise_gate_threshold > 0 and m_prev is not None:
                        dist = (s - m_prev).abs().mean(-1, keepdim=True)
                        r = torch.relu(
                            (dist - sm.surprise_gate_threshold) * sm.surprise_gate_sharpness
                        )
                        g = r / (r + 1)
                        updated = m_prev + g * (updated - m_prev)
                    if sm.write_gate:
                        gate = (chunk_hits[layer] / (chunk_hits[layer] + 1e-6)).unsqueeze(-1)
                        old = torch.zeros_like(updated) if m_prev is None else m_prev
                        updated = old * (1 - gate) + updated * gate
                    memory[layer] = updated
                    chunk_sum[layer] = torch.zeros_like(chunk_sum[layer])
                    chunk_hits[layer] = torch.zeros_like(chunk_hits[layer])
                u = branch
            x = torch.relu(torch.einsum("bd,hdn->bhn", u, enc))
            q = rope(x, t) if position == "rope" else x
            out = torch.einsum("bhn,bhnd->bhd", q, rho[layer])
            rho[layer] = rho[layer] + torch.einsum("bhn,bd->bhnd", q, u)
            if position == "alibi":
                rho[layer] = rho[layer] * decay.view(1, H, 1, 1)
            y = x * torch.relu(torch.einsum("bhd,hdn->bhn", ln(out), enc_v))
            u = ln(u + ln(y.reshape(B, H * N) @ dec))
        logits[:, t] = u @ head
    return logits


def events(b, t, seed=0, rate=0.3):
    """A 0/1 mask with some chunks free of events."""
    return (torch.rand(b, t, generator=torch.Generator().manual_seed(seed)) < rate).long()


# ------------------------------------------------------------------ against the formulas
@pytest.mark.parametrize("gates", sorted(GATES))
@pytest.mark.parametrize(("position", "last_layers"), [("rope", None), ("alibi", 1)])
def test_model_matches_token_by_token_reference_fp64(gates, position, last_layers):
    sm = summary(last_layers=last_layers, **GATES[gates])
    model = tiny_model(torch.float64, seed=2, position=position, summary_memory=sm)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    idx = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = events(2, 14)
    expected = reference(weights, idx, 2, position, sm, mask)
    logits, _ = model(idx, summary_event_mask=mask)
    assert (logits - expected).abs().max().item() < 1e-10
    # ... and split at calls that are not multiples of chunk_tokens
    state = model.init_state(2)
    pieces = [
        model(idx[:, a:b], state=state, summary_event_mask=mask[:, a:b])[0]
        for a, b in ((0, 4), (4, 5), (5, 11), (11, 14))
    ]
    assert (torch.cat(pieces, 1) - expected).abs().max().item() < 1e-10
    # the memory changes the logits (so the comparison above is not vacuous)
    off, _ = tiny_model(torch.float64, seed=2, position=position)(idx)
    assert (off - expected).abs().max().item() > 1e-3


def test_write_gate_without_events_writes_nothing():
    """No mask (or no event): gate 0, the memory stays zero and the model equals one without
    summary memory, bit for bit."""
    gated = tiny_model(summary_memory=summary(write_gate=True))
    plain = tiny_model()
    idx = torch.randint(0, VOCAB, (2, 10))
    expected, _ = plain(idx)
    state = gated.init_state(2)
    assert torch.equal(gated(idx, state=state)[0], expected)
    assert torch.equal(gated(idx, summary_event_mask=torch.zeros(2, 10))[0], expected)
    assert all(not c.memory.any() for c in state.summary)


@pytest.mark.parametrize("seq_len", [1, 5, 12])
def test_same_phase_fast_path_equals_the_general_scatter_gather_fp64(seq_len):
    """Rows at the same place in their chunk take the reshape path; the scatter/gather path
    (taken when rows differ) is its twin: values, carry and gradients agree."""
    sm = summary(chunk_tokens=4, **GATES["both"])
    g = torch.Generator().manual_seed(0)
    u = torch.randn(3, 1, seq_len, 8, generator=g, dtype=torch.float64, requires_grad=True)
    carry = SummaryCarry(
        torch.randn(3, 1, 1, 8, generator=g, dtype=torch.float64),
        torch.randn(3, 1, 1, 8, generator=g, dtype=torch.float64),
        torch.tensor([1, 0, 2]),
    )
    position, mask = torch.tensor([6, 10, 2]), events(3, seq_len)  # phase 2 in every row
    results = []
    for fast in (True, False):
        branch, new = summary_branch(u, carry, position, sm, mask, same_phase_fast_path=fast)
        (grad,) = torch.autograd.grad((branch * branch).sum() + new.memory.sum(), u)
        results.append((branch, *new, grad))
    for fast, slow in zip(*results, strict=True):
        assert_close(fast, slow, rtol=1e-12)


# ------------------------------------------------------------------ off: nothing changes
def test_off_adds_no_parameter_buffer_or_state_and_changes_no_bit():
    idx = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    default = tiny_model()
    # every summary setting but `enabled` changed: still off
    off = tiny_model(
        summary_memory=SummaryMemoryConfig(
            enabled=False, chunk_tokens=2, residual_scale=1.0, surprise_gate_threshold=0.5
        )
    )
    assert [n for n, _ in off.named_parameters()] == [n for n, _ in default.named_parameters()]
    assert sorted(off.state_dict()) == [
        "decoder",
        "embed.weight",
        "encoder",
        "encoder_v",
        "lm_head",
        "rope_freqs",
    ]
    expected, _ = default(idx)
    state = off.init_state(2)
    assert torch.equal(off(idx, state=state)[0], expected)
    assert torch.equal(off(idx, summary_event_mask=mask)[0], expected)  # the mask: no effect
    assert sorted(state.state_dict()) == ["position", "rho.0", "rho.1"]
    assert state.summary == [None, None]


def test_a_mask_without_the_write_gate_has_no_effect():
    model = tiny_model(summary_memory=summary())
    idx = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(model(idx, summary_event_mask=torch.ones(2, 9))[0], model(idx)[0])


# ------------------------------------------------------------------ calls, executors, generation
@pytest.mark.parametrize("splits", [[3, 6, 3], [6, 6], [1] * 12, [5, 7]])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_split_calls_equal_one_call_with_gradients_fp32(splits, executor):
    """[3, 6, 3] and [6, 6] split at multiples of chunk_tokens; [1]*12 and [5, 7] do not and
    still equal one call (the chunks follow absolute positions). Gradients too."""
    sm = summary(**GATES["both"])
    model = tiny_model(executor=executor, summary_memory=sm)
    idx = torch.randint(0, VOCAB, (2, 12))
    targets = torch.randint(0, VOCAB, (2, 12))
    mask = events(2, 12, seed=3)

    def run(pieces):
        model.zero_grad(set_to_none=True)
        state, hidden, start = model.init_state(2), [], 0
        for size in pieces:
            end = start + size
            hidden.append(
                model.forward_hidden(
                    idx[:, start:end], state, summary_event_mask=(mask[:, start:end])
                )
            )
            start = end
        hidden = torch.cat(hidden, 1)
        model.loss_from_hidden(hidden, targets).backward()
        return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, state

    full_hidden, full_grads, full_state = run([12])
    hidden, grads, state = run(splits)
    assert_close(hidden, full_hidden, rtol=1e-5)
    assert_close(grads, full_grads, rtol=1e-5)
    for got, ref in zip(state.summary, full_state.summary, strict=True):
        assert_close(got.memory, ref.memory, rtol=1e-5)


def test_executors_agree_with_summary_memory():
    model = tiny_model(summary_memory=summary(chunk_tokens=4, surprise_gate_threshold=0.2))
    idx = torch.randint(0, VOCAB, (2, 11))
    ref = model.forward_hidden(idx, executor="dense")
    for executor in ("chunked", "recurrent"):
        assert_close(model.forward_hidden(idx, executor=executor), ref, rtol=1e-5, msg=executor)


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_greedy_generation_equals_full_prefix_rerun(position):
    """Token-by-token generation (one recurrent step per token) continues exactly as the full
    forward over the whole prefix; the prompt's length is not a multiple of chunk_tokens."""
    sm = summary(chunk_tokens=4, surprise_gate_threshold=0.2, residual_scale=1.0)
    model = tiny_model(torch.float64, position=position, summary_memory=sm).eval()
    prompt = torch.randint(0, VOCAB, (2, 5))
    fast = sampling.generate(model, prompt, 24, temperature=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(24):
            logits, _ = model(seq)
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(fast, seq)
    plain = tiny_model(torch.float64, position=position).eval()
    assert not torch.equal(sampling.generate(plain, prompt, 24, temperature=0), fast)


def test_generation_marks_the_events_of_the_tokens_it_produces(monkeypatch):
    """With the write gate, generation finds events in its own tokens (a 3-token trigger,
    also spanning the prompt's end): the masks its calls pass, put together, are the mask of
    the whole sequence but its last token, and it continues exactly as the full forward over
    the whole prefix with the prefix's mask. Four symbols, sampled: the trigger occurs often."""
    trigger = SummaryEventTrigger(sequence=(2, 3, 0))
    sm = summary(chunk_tokens=4, write_gate=True, residual_scale=1.0)
    model = tiny_model(torch.float64, vocab_size=4, summary_memory=sm).eval()
    passed = []
    forward_hidden = model.forward_hidden

    def recording(idx, *args, summary_event_mask=None, **kwargs):
        passed.append(summary_event_mask)
        return forward_hidden(idx, *args, summary_event_mask=summary_event_mask, **kwargs)

    monkeypatch.setattr(model, "forward_hidden", recording)
    prompt = torch.tensor([[3, 0, 1, 2], [1, 2, 1, 2]])
    fast = sampling.generate(
        model, prompt, 40, generator=torch.Generator().manual_seed(0), summary_events=trigger
    )
    monkeypatch.undo()
    expected = trigger.mask(fast)
    assert expected[:, 5:].sum() >= 2  # events among the generated tokens
    # every token but the last is read back (the last one is never read: nothing follows it)
    assert torch.equal(torch.cat(passed, dim=1), expected[:, :-1])
    seq, generator = prompt, torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(40):
            logits, _ = model(seq, summary_event_mask=trigger.mask(seq))
            token = sample_next_token(logits[:, -1].float(), 1.0, None, generator)
            seq = torch.cat([seq, token.unsqueeze(1)], dim=1)
    assert torch.equal(fast, seq)


def test_generation_carry_is_fixed_size():
    model = tiny_model(summary_memory=summary(chunk_tokens=4))
    state = model.init_state(1)
    shapes = []
    for _ in range(9):
        model.forward_hidden(torch.randint(0, VOCAB, (1, 1)), state, executor="recurrent")
        shapes.append([tuple(t.shape) for c in state.summary for t in c])
    assert all(s == shapes[0] for s in shapes)


# ------------------------------------------------------------------ the carry in ModelState
def test_reset_clears_that_rows_carry_only():
    """Row 1 is reset mid-chunk and equals a fresh single-row run; row 0 continues."""
    model = tiny_model(torch.float64, summary_memory=summary(**GATES["both"]))
    first, second = torch.randint(0, VOCAB, (2, 7)), torch.randint(0, VOCAB, (2, 8))
    m1, m2 = events(2, 7, seed=4), events(2, 8, seed=5)
    state = model.init_state(2)
    model.forward_hidden(first, state, summary_event_mask=m1)
    kept = state.clone()
    state.reset_(torch.tensor([False, True]))
    for carry, old in zip(state.summary, kept.summary, strict=True):
        for t, t_old in zip(carry, old, strict=True):
            assert torch.equal(t[0], t_old[0]) and not t[1].any()
    both = model.forward_hidden(second, state, summary_event_mask=m2)
    solo = model.init_state(1)
    row0 = model.forward_hidden(
        torch.cat([first[:1], second[:1]], 1),
        solo,
        summary_event_mask=torch.cat([m1[:1], m2[:1]], 1),
    )[:, 7:]
    row1 = model.forward_hidden(second[1:], summary_event_mask=m2[1:])
    assert_close(both[:1], row0, rtol=1e-12)
    assert_close(both[1:], row1, rtol=1e-12)


def test_carry_detach_clone_to_and_state_dict_round_trip():
    model = tiny_model(summary_memory=summary(last_layers=1, write_gate=True))
    state = model.init_state(2)
    model.forward_hidden(torch.randint(0, VOCAB, (2, 7)), state, summary_event_mask=events(2, 7))
    assert state.summary[0] is None  # only the last layer has a memory
    assert state.summary[1].memory.requires_grad
    state.detach_()
    assert not state.summary[1].memory.requires_grad
    clone = state.clone()
    assert clone.summary[1].memory is not state.summary[1].memory
    moved = state.clone().to("meta")
    assert all(t.device.type == "meta" for t in moved.summary[1])
    sd = state.state_dict()
    assert {"summary_memory.1", "summary_chunk_sum.1", "summary_chunk_hits.1"} <= set(sd)
    restored = model.init_state(2).load_state_dict(sd)
    for got, ref in zip(restored.summary[1], state.summary[1], strict=True):
        assert torch.equal(got, ref)
    assert restored.summary[0] is None


def test_old_state_dict_without_summary_keys_loads_as_a_fresh_memory():
    model = tiny_model(summary_memory=summary())
    old = tiny_model()  # what older code saved: position and rho only
    state = old.init_state(2)
    old.forward_hidden(torch.randint(0, VOCAB, (2, 6)), state)
    loaded = model.init_state(2).load_state_dict(state.state_dict())
    assert loaded.summary == [None, None]
    model.forward_hidden(torch.randint(0, VOCAB, (2, 3)), loaded)  # and runs on
    assert loaded.summary[0] is not None


def test_bad_summary_entries_are_refused():
    state = tiny_model(summary_memory=summary()).init_state(2)
    pos = torch.zeros(2, dtype=torch.long)
    with pytest.raises(CheckpointError, match="partial summary memory: missing"):
        state.load_state_dict({"position": pos, "summary_memory.0": torch.zeros(2, 1, 1, 16)})
    with pytest.raises(CheckpointError, match=r"'summary_chunk_hits.0' must be \[2\] long"):
        state.load_state_dict({"position": pos, "summary_chunk_hits.0": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"'summary_memory.1' must be \[2, 1, 1, D\]"):
        state.load_state_dict({"position": pos, "summary_memory.1": torch.zeros(2, 16)})
    with pytest.raises(CheckpointError, match="unexpected model state entry 'summary_memory.2'"):
        state.load_state_dict({"position": pos, "summary_memory.2": torch.zeros(2, 1, 1, 16)})


def test_mask_shape_is_checked():
    model = tiny_model(summary_memory=summary())
    with pytest.raises(ValueError, match=r"summary_event_mask must have the tokens' shape"):
        model(torch.zeros(2, 5, dtype=torch.long), summary_event_mask=torch.zeros(2, 4))


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"enabled": 1}, "model.summary_memory.enabled must be true or false"),
        ({"last_layers": 0}, r"model.summary_memory.last_layers must be in \[1, model.n_layer"),
        ({"last_layers": 7}, r"last_layers must be in \[1, model.n_layer \(6\)\], got 7"),
        ({"chunk_tokens": 0}, "model.summary_memory.chunk_tokens must be a positive integer"),
        ({"residual_scale": -1.0}, "model.summary_memory.residual_scale must be a non-negative"),
        ({"state_decay": 1.5}, r"model.summary_memory.state_decay must be a number in \[0, 1\]"),
        ({"state_update_scale": float("nan")}, "model.summary_memory.state_update_scale"),
        ({"surprise_gate_threshold": -0.1}, "model.summary_memory.surprise_gate_threshold"),
        ({"surprise_gate_sharpness": 0.0}, "surprise_gate_sharpness must be a positive number"),
        ({"write_gate": "yes"}, "model.summary_memory.write_gate must be true or false"),
        ({"enabled": False, "write_gate": True}, "write_gate=true needs .*enabled=true"),
    ],
)
def test_summary_config_errors_name_the_key(fields, message):
    with pytest.raises(ConfigError, match=message):
        BDHConfig(summary_memory=SummaryMemoryConfig(**{"enabled": True, **fields})).validate()


def test_summary_config_from_dict_and_layers():
    cfg = BDHConfig.from_dict({"n_layer": 4, "summary_memory": {"enabled": True, "last_layers": 2}})
    assert cfg.summary_memory.layers(4) == range(2, 4)
    assert SummaryMemoryConfig(enabled=True).layers(4) == range(4)
    assert SummaryMemoryConfig().layers(4) == range(0)
    with pytest.raises(ConfigError, match="unknown key model.summary_memory.chunk_size"):
        BDHConfig.from_dict({"summary_memory": {"chunk_size": 3}})
