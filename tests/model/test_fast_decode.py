"""The fast decoder against its twins: the generic recurrent step and a full forward over the
whole sequence; batched generation against each row generated alone; stop tokens."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers import assert_close, tiny_model

from bdh_train.model import QuantConfig, decoders, sampling
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.model.decoders import FastDecoder, GenericDecoder, fast_decoder_unsupported

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def _model(dtype: torch.dtype, position: str, **overrides):
    model = tiny_model(dtype, position=position, **overrides).eval()
    with torch.no_grad():
        if position == "alibi_learned":
            model.decay_log_gain.copy_(torch.tensor([0.7, -0.9])[: model.config.n_head])
        if model.norm is not None:  # an affine norm away from the identity
            model.norm.weight.uniform_(0.5, 1.5)
            model.norm.bias.normal_(0.0, 0.1)
    return model


CASES = [
    (torch.float32, "rope", {}),
    (torch.float64, "rope", {"norm": "layernorm_affine"}),
    (torch.float32, "alibi", {}),
    (torch.float64, "alibi", {}),
    (torch.float64, "alibi_learned", {}),
    (torch.float64, "alibi_spread", {}),
    (torch.float64, "alibi_slow", {}),
]


@pytest.mark.parametrize(("dtype", "position", "overrides"), CASES)
def test_fast_step_logits_equal_generic_step_and_full_forward(
    monkeypatch, dtype, position, overrides
):
    """Teacher-forced: rows at different positions (prompts of 5 and 2 tokens read alone),
    then 9 steps; the pending tokens are folded every 4 steps and the rope table moves on
    every 3 positions. After a flush, the states agree too. The fixed-shape step (what CUDA
    captures as a graph) runs here on the CPU and agrees as well."""
    monkeypatch.setattr(decoders, "ROPE_TABLE_TOKENS", 3)
    monkeypatch.setattr(decoders, "FOLD_TOKENS", 4)
    model = _model(dtype, position, **overrides)
    seq = torch.randint(0, 32, (2, 14), generator=torch.Generator().manual_seed(1))
    starts = (5, 2)
    with torch.no_grad():
        full = [model(seq[b : b + 1])[0][0] for b in range(2)]  # [T, V] per row, no state
        got, rho = {}, {}
        builders = (
            ("fast", partial(FastDecoder, static=False)),
            ("static", partial(FastDecoder, static=True)),
            ("generic", GenericDecoder),
        )
        for name, build in builders:
            states = []
            for b, start in enumerate(starts):
                state = model.init_state(1)
                model.forward_hidden(seq[b : b + 1, :start], state)
                states.append(state)
            decoder = build(model, type(states[0]).concat(states))
            logits = []
            for step in range(9):
                tokens = torch.stack([seq[b, start + step] for b, start in enumerate(starts)])
                logits.append(model.logits_from_hidden(decoder.step(tokens)))
            got[name] = torch.stack(logits, dim=1)  # [B, 9, V]
            assert decoder.state.position.tolist() == [start + 9 for start in starts]
            if isinstance(decoder, FastDecoder):
                assert decoder.pending == 1
                decoder.flush()
            rho[name] = torch.stack(decoder.state.rho)
    for b, start in enumerate(starts):
        want = full[b][start : start + 9]
        assert_close(got["fast"][b], want, rtol=TOLERANCE[dtype], msg=f"fast, row {b}")
        for name in ("fast", "static"):
            assert_close(
                got[name][b], got["generic"][b], rtol=TOLERANCE[dtype], msg=f"{name}, row {b}"
            )
    for name in ("fast", "static"):
        assert_close(
            rho[name], rho["generic"], rtol=TOLERANCE[dtype], msg=f"{name}: state after a flush"
        )


@pytest.mark.parametrize("position", ["rope", "alibi", "alibi_learned"])
def test_fast_generation_draws_the_generic_tokens(position):
    model = _model(torch.float32, position)
    prompt = torch.randint(0, 32, (2, 4), generator=torch.Generator().manual_seed(2))
    for temperature, top_k in ((0.0, None), (1.0, 8)):
        outs = [
            sampling.generate(
                model,
                prompt,
                12,
                temperature,
                top_k,
                torch.Generator().manual_seed(5),
                decoder=name,
            )
            for name in ("fast", "generic")
        ]
        assert torch.equal(outs[0], outs[1]), f"temperature {temperature}"


def test_batch_rows_generate_what_they_generate_alone():
    model = _model(torch.float64, "rope")
    prompts = [[3, 1, 4], [1], [5, 9, 2, 6, 5, 3]]
    batch = sampling.generate_batch(model, prompts, 10, temperature=0)
    generic = sampling.generate_batch(model, prompts, 10, temperature=0, decoder="generic")
    for row, prompt in enumerate(prompts):
        alone = sampling.generate(model, torch.tensor(prompt), 10, temperature=0, decoder="generic")
        assert torch.equal(batch[row], alone), f"row {row}"
        assert torch.equal(generic[row], alone), f"row {row}, generic decoder"


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shape"])
def test_stop_tokens_end_rows_and_stopped_rows_leave_the_batch(monkeypatch, static):
    """Rows that stop leave the batch; the fixed-shape step (CUDA's graph step, here on the
    CPU) drops their rows as the eager step does and draws the eager step's tokens."""
    model = _model(torch.float64, "rope")
    prompts = [[3, 1, 4], [1], [5, 9, 2, 6, 5, 3]]
    alone = sampling.generate_batch(model, prompts, 12, 0.0)
    monkeypatch.setattr(decoders, "FastDecoder", partial(FastDecoder, static=static))
    free = [row[len(p) :].tolist() for row, p in zip(alone, prompts, strict=True)]
    stops = {free[0][2], free[1][5]}  # row 0 stops by its 3rd token, row 1 by its 6th

    def cut(tokens: list[int]) -> list[int]:
        ends = [i for i, t in enumerate(tokens) if t in stops]
        return tokens[: ends[0] + 1] if ends else tokens

    stepped_rows: list[int] = []
    real_step = FastDecoder.step
    monkeypatch.setattr(
        FastDecoder, "step", lambda self, t: stepped_rows.append(t.shape[0]) or real_step(self, t)
    )
    out = sampling.generate_batch(model, prompts, 12, 0.0, stop_tokens=sorted(stops))
    for row, prompt in enumerate(prompts):
        assert out[row][: len(prompt)].tolist() == prompt
        assert out[row][len(prompt) :].tolist() == cut(free[row]), f"row {row}"
    lengths = [len(cut(tokens)) for tokens in free]
    # step k (k = 1..) reads the tokens drawn at step k-1 of the rows still going
    assert stepped_rows == [sum(n > k for n in lengths) for k in range(1, max(lengths))]

    generic = sampling.generate_batch(
        model, prompts, 12, 0.0, stop_tokens=sorted(stops), decoder="generic"
    )
    assert all(torch.equal(g, f) for g, f in zip(generic, out, strict=True)), "generic decoder"

    stream = list(
        sampling.stream_generate_batch(
            model, prompts, 12, 0.0, stop_tokens=sorted(stops), pad_id=-7
        )
    )
    assert len(stream) == min(12, max(lengths))
    for row, n in enumerate(lengths):
        column = [int(step[row]) for step in stream]
        assert column[:n] == cut(free[row]) and all(t == -7 for t in column[n:]), f"row {row}"


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shape"])
def test_the_state_read_by_rows_is_the_batched_product(monkeypatch, static):
    """float32 on the CPU reads q.rho as weighted row sums (`F.embedding_bag`); the batched
    product is its twin. Three rows at different positions step 6 times, two of them (in
    the other order) step 5 more: logits agree to fp32 1e-5 at every step, and each form is
    the one that ran (row sums once per layer and step); only float32 on the CPU chooses
    the row sums."""
    monkeypatch.setattr(decoders, "FOLD_TOKENS", 4)
    model = _model(torch.float32, "rope")
    choose = decoders.reads_state_by_rows
    bags: list[int] = []
    real_bag = decoders.F.embedding_bag
    monkeypatch.setattr(
        decoders.F, "embedding_bag", lambda *a, **k: bags.append(1) or real_bag(*a, **k)
    )

    def logits_when(by_rows: bool) -> torch.Tensor:
        monkeypatch.setattr(decoders, "reads_state_by_rows", lambda rho: by_rows)
        bags.clear()
        states = []
        for prompt in ([3, 1, 4], [1], [5, 9, 2, 6, 5]):
            state = model.init_state(1)
            model.forward_hidden(torch.tensor([prompt]), state)
            states.append(state)
        decoder = FastDecoder(model, type(states[0]).concat(states), static=static)
        steps = []
        for step in range(11):
            if step == 6:
                decoder.keep_rows(torch.tensor([2, 0]))
            hidden = decoder.step(torch.arange(decoder.state.batch_size) + step % 7)
            steps.append(model.logits_from_hidden(hidden))
        return torch.cat(steps)

    with torch.no_grad():
        by_product = logits_when(False)
        assert not bags, "the product form ran row sums"
        by_rows = logits_when(True)
    assert len(bags) == 11 * model.config.n_layer
    assert_close(by_rows, by_product, rtol=1e-5)
    for rho, expected in (
        (torch.zeros(1), True),
        (torch.zeros(1, dtype=torch.float64), False),
        (torch.zeros(1, device="meta"), False),  # a device other than the CPU
    ):
        assert choose(rho) == expected, rho


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shape"])
def test_rows_that_stay_after_others_stop_keep_their_own_positions(monkeypatch, static):
    """Teacher-forced rope rows at positions 5, 2 and 7: 3 steps, the row at 2 (the lowest
    position) leaves and the others swap places, 3 steps, then one row is left (the
    single-row step reads its rotation by the first position), 3 steps. Each row's logits
    are those of a full forward over its own sequence (fp64, 1e-10); the rope table moves
    every 3 positions."""
    monkeypatch.setattr(decoders, "ROPE_TABLE_TOKENS", 3)
    monkeypatch.setattr(decoders, "FOLD_TOKENS", 4)
    model = _model(torch.float64, "rope")
    seq = torch.randint(0, 32, (3, 16), generator=torch.Generator().manual_seed(2))
    starts = [5, 2, 7]
    with torch.no_grad():
        full = [model(seq[b : b + 1])[0][0] for b in range(3)]
        states = []
        for b, start in enumerate(starts):
            state = model.init_state(1)
            model.forward_hidden(seq[b : b + 1, :start], state)
            states.append(state)
        decoder = FastDecoder(model, type(states[0]).concat(states), static=static)
        rows, done = [0, 1, 2], [0, 0, 0]
        for keep in (None, [2, 0], [1]):
            if keep is not None:
                decoder.keep_rows(torch.tensor(keep))
                rows = [rows[k] for k in keep]
            for _ in range(3):
                tokens = torch.stack([seq[r, starts[r] + done[r]] for r in rows])
                logits = model.logits_from_hidden(decoder.step(tokens))
                for i, r in enumerate(rows):
                    at = starts[r] + done[r]
                    assert_close(logits[i], full[r][at], rtol=1e-10, msg=f"row {r} at {at}")
                    done[r] += 1
            assert decoder.state.position.tolist() == [starts[r] + done[r] for r in rows]


def test_all_rows_stopping_ends_the_stream():
    model = _model(torch.float32, "alibi")
    first = sampling.generate_batch(model, [[1, 2], [3]], 1, 0.0)
    stops = [int(row[-1]) for row in first]
    assert (
        len(list(sampling.stream_generate_batch(model, [[1, 2], [3]], 50, 0.0, stop_tokens=stops)))
        == 1
    )


def test_unsupported_models_fall_back_to_the_generic_decoder():
    summary = tiny_model(summary_memory=SummaryMemoryConfig(enabled=True, chunk_tokens=2)).eval()
    quantized = tiny_model(quant=QuantConfig(enable=True)).eval()
    noisy = tiny_model(dropout=0.1).train()
    shifted = tiny_model(token_shift=True).eval()
    for model, reason in (
        (summary, "summary"),
        (quantized, "quantized"),
        (noisy, "dropout"),
        (shifted, "token shift"),
    ):
        assert reason in fast_decoder_unsupported(model)
        with pytest.raises(ValueError, match=reason):
            sampling.generate(model, torch.tensor([1, 2]), 2, decoder="fast")
        prompt = torch.tensor([1, 2])
        auto = sampling.generate(model, prompt, 3, 0.0)
        assert torch.equal(auto, sampling.generate(model, prompt, 3, 0.0, decoder="generic"))
    assert fast_decoder_unsupported(tiny_model().eval()) is None
    assert fast_decoder_unsupported(tiny_model(dropout=0.1).eval()) is None


def test_bad_batch_prompts_are_refused():
    model = tiny_model().eval()
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        sampling.generate_batch(model, [[1], []], 2)
    with pytest.raises(ValueError, match="at least one prompt"):
        sampling.generate_batch(model, [], 2)
    with pytest.raises(ValueError, match="unknown decoder"):
        sampling.generate(model, torch.tensor([1]), 2, decoder="turbo")


def test_batch_rows_with_a_summary_memory_generate_what_they_generate_alone():
    """The generic decoder's batch: summary carries joined per row, rows at different places
    in their chunks; a stop token drops a row's carry."""
    config = SummaryMemoryConfig(enabled=True, chunk_tokens=2)
    model = tiny_model(torch.float64, summary_memory=config).eval()
    prompts = [[3, 1, 4], [1], [5, 9, 2, 6]]
    alone = [sampling.generate(model, torch.tensor(p), 6, temperature=0) for p in prompts]
    stop = int(alone[1][2])  # row 1's 2nd new token
    batch = sampling.generate_batch(model, prompts, 6, temperature=0, stop_tokens=[stop])
    for row, (prompt, tokens) in enumerate(zip(prompts, alone, strict=True)):
        new = tokens[len(prompt) :].tolist()
        cut = new[: new.index(stop) + 1] if stop in new else new
        assert batch[row].tolist() == prompt + cut, f"row {row}"
