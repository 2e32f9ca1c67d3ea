"""O(1)-per-token generation equals re-running the full prefix (issue 2)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model


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
