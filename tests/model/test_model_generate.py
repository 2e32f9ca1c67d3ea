"""O(1)-per-token generation equals re-running the full prefix."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_model

from bdh_train.model import sampling
from bdh_train.model.sampling import sample_next_token


@pytest.mark.parametrize("position", ["rope", "alibi", "alibi_learned"])
def test_greedy_recurrent_equals_full_prefix_rerun(position):
    model = tiny_model(torch.float64, position=position).eval()
    if position == "alibi_learned":
        with torch.no_grad():
            model.decay_log_gain.copy_(torch.tensor([0.7, -0.9]))
    prompt = torch.randint(0, 32, (2, 5))
    fast = sampling.generate(model, prompt, 64, temperature=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(64):
            logits, _ = model(seq)  # no state: the whole prefix again
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(fast, seq)


def test_stream_generate_yields_one_token_at_a_time_and_is_seeded():
    model = tiny_model().eval()
    prompt = torch.tensor([1, 2, 3])
    stream = sampling.stream_generate(
        model, prompt, 5, temperature=1.0, top_k=4, generator=torch.Generator().manual_seed(7)
    )
    tokens = [int(t) for t in stream]
    assert len(tokens) == 5
    again = sampling.generate(
        model, prompt, 5, temperature=1.0, top_k=4, generator=torch.Generator().manual_seed(7)
    )
    assert again[3:].tolist() == tokens
    assert again[:3].tolist() == [1, 2, 3]


def test_top_k_one_is_greedy():
    model = tiny_model().eval()
    prompt = torch.tensor([[4, 5]])
    sampled = sampling.generate(
        model, prompt, 8, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(sampled, sampling.generate(model, prompt, 8, temperature=0))


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="at least one token"):
        sampling.generate(tiny_model(), torch.zeros(1, 0, dtype=torch.long), 3)


def _noisy_and_clean():
    """The same weights twice: dropout 0.5 (noisy) and dropout 0.0 (the reference)."""
    noisy = tiny_model(dropout=0.5)
    clean = tiny_model(dropout=0.0, seed=1)
    clean.load_state_dict(noisy.state_dict())
    return noisy, clean


def test_dropout_is_off_in_eval_forward_and_in_generation():
    noisy, clean = _noisy_and_clean()
    idx = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference, _ = clean.eval()(idx)
        noisy.train()
        in_training, _ = noisy(idx)
        assert not torch.allclose(in_training, reference)  # dropout 0.5 is visible in train()
        noisy.eval()
        first, _ = noisy(idx)
        second, _ = noisy(idx)
    assert torch.equal(first, second), "two eval() forwards differ: dropout is still on"
    assert torch.equal(first, reference), "eval() forward differs from the dropout-free model"

    prompt = torch.tensor([[4, 5, 6]])
    for temperature, top_k in [(0.0, None), (1.0, 8)]:
        outs = [
            sampling.generate(
                model,
                prompt,
                24,
                temperature=temperature,
                top_k=top_k,
                generator=torch.Generator().manual_seed(11),
            )
            for model in (clean, noisy, noisy)
        ]
        assert torch.equal(outs[1], outs[0]), f"generation (T={temperature}) used dropout"
        assert torch.equal(outs[2], outs[1]), f"two generations (T={temperature}) differ"


LOGITS = [1.5, -0.5, 3.0, 0.25, 2.0, -2.0]


def tempered_top_k(logits: list[float], temperature: float, top_k: int | None) -> list[float]:
    """softmax(logits / T) over the top_k largest logits, zero elsewhere (plain Python)."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: scaled[i], reverse=True)
    kept = set(order[: top_k or len(scaled)])
    total = sum(math.exp(scaled[i]) for i in kept)
    return [math.exp(scaled[i]) / total if i in kept else 0.0 for i in range(len(scaled))]


@pytest.mark.parametrize(
    ("temperature", "top_k"), [(0.5, 3), (0.7, 2), (2.0, 5), (2.0, None), (1.0, 4)]
)
def test_sampler_draws_from_tempered_softmax_of_the_top_k(monkeypatch, temperature, top_k):
    """The distribution handed to torch.multinomial, against the hand-computed one."""
    handed: list[torch.Tensor] = []
    real_multinomial = torch.multinomial

    def capture(probs, *args, **kwargs):
        handed.append(probs.detach().clone())
        return real_multinomial(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", capture)
    token = sample_next_token(
        torch.tensor([LOGITS], dtype=torch.float64),
        temperature=temperature,
        top_k=top_k,
        generator=torch.Generator().manual_seed(0),
    )
    want = tempered_top_k(LOGITS, temperature, top_k)
    assert len(handed) == 1 and handed[0].shape == (1, len(LOGITS))
    got = handed[0][0].tolist()
    for i, (p, q) in enumerate(zip(got, want, strict=True)):
        if q == 0.0:
            assert p == 0.0, f"token {i} is outside the top {top_k} but has probability {p}"
        else:
            assert p == pytest.approx(q, rel=1e-12, abs=0), f"token {i}: {p} != {q} by hand"
    assert want[int(token)] > 0.0


def test_sampled_frequencies_follow_tempered_top_k_softmax():
    """20000 seeded float32 draws at T=0.5, top-3: nothing outside the top 3, and a chi-square
    against softmax(logits / 0.5) far below its 1e-6 tail (T ignored gives ~8000)."""
    n = 20000
    logits = torch.tensor(LOGITS).expand(n, -1)
    tokens = sample_next_token(
        logits, temperature=0.5, top_k=3, generator=torch.Generator().manual_seed(1234)
    )
    counts = torch.bincount(tokens, minlength=len(LOGITS)).tolist()
    want = tempered_top_k(LOGITS, 0.5, 3)  # tokens 2, 4, 0: e^6, e^4, e^3 normalized
    assert [i for i, q in enumerate(want) if q > 0] == [0, 2, 4]
    outside = {i: c for i, (c, q) in enumerate(zip(counts, want, strict=True)) if q == 0.0}
    assert not any(outside.values()), f"drawn outside the top 3: {outside}"
    chi2 = sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, want, strict=True) if q > 0)
    # 3 categories, 2 degrees of freedom: P(chi2 > x) = exp(-x / 2), so x = 2 ln(1e6) at 1e-6
    assert chi2 < 2 * math.log(1e6), f"counts {counts} vs expected {[n * q for q in want]}"
