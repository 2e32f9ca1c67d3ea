"""O(1)-per-token generation equals re-running the full prefix (issue 2)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_greedy_recurrent_equals_full_prefix_rerun(position):
    model = tiny_model(torch.float64, position=position).eval()
    prompt = torch.randint(0, 32, (2, 5))
    fast = model.generate(prompt, 64, temperature=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(64):
            logits, _ = model(seq)  # no state: the whole prefix again
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(fast, seq)


def test_stream_generate_yields_one_token_at_a_time_and_is_seeded():
    model = tiny_model().eval()
    prompt = torch.tensor([1, 2, 3])
    stream = model.stream_generate(
        prompt, 5, temperature=1.0, top_k=4, generator=torch.Generator().manual_seed(7)
    )
    tokens = [int(t) for t in stream]
    assert len(tokens) == 5
    again = model.generate(
        prompt, 5, temperature=1.0, top_k=4, generator=torch.Generator().manual_seed(7)
    )
    assert again[3:].tolist() == tokens
    assert again[:3].tolist() == [1, 2, 3]


def test_top_k_one_is_greedy():
    model = tiny_model().eval()
    prompt = torch.tensor([[4, 5]])
    sampled = model.generate(
        prompt, 8, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(sampled, model.generate(prompt, 8, temperature=0))


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="at least one token"):
        tiny_model().generate(torch.zeros(1, 0, dtype=torch.long), 3)


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
            model.generate(
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
