"""The generation functions' contract beyond their tokens' values: defaults, the number of
steps a stream takes, integer prompts of any dtype, a batch's sampling options, the fast
decoder on a state that read nothing, at batch 1, and which of its steps ran."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import assert_close, tiny_model
from test_layers import imports, modules

from bdh_train.data.events import SummaryEventTrigger
from bdh_train.generation import continuation
from bdh_train.model import BDH, QuantConfig, decoders
from bdh_train.model import sampling as generation
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.model.decoders import FastDecoder, GenericDecoder


def _seeded(seed: int = 5) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(result) -> list[int]:
    """A generation's tokens as one flat list (a tensor, a stream of tensors or a list)."""
    if isinstance(result, torch.Tensor):
        return result.reshape(-1).tolist()
    return [t for part in result for t in _tokens(part)]


CALLS = {
    "generate": lambda model, **kw: generation.generate(model, torch.tensor([3, 1]), 8, **kw),
    "stream_generate": lambda model, **kw: list(
        generation.stream_generate(model, torch.tensor([3, 1]), 8, **kw)
    ),
    "generate_batch": lambda model, **kw: generation.generate_batch(model, [[3, 1], [2]], 8, **kw),
    "stream_generate_batch": lambda model, **kw: list(
        generation.stream_generate_batch(model, [[3, 1], [2]], 8, **kw)
    ),
}


def _sharp_model():
    """A tiny model whose logits spread over a few units, so that the temperature changes
    which tokens a seeded draw picks (an untrained head's logits are all near 0)."""
    model = tiny_model().eval()
    with torch.no_grad():
        model.lm_head.mul_(30.0)
    return model


@pytest.mark.parametrize("name", list(CALLS))
def test_the_defaults_are_temperature_1_and_the_auto_decoder(monkeypatch, name):
    """The module functions' own defaults (the model's methods are these functions): the
    default call draws what temperature 1 draws, and steps with the fast decoder (auto's choice
    for this model; both decoders draw the same tokens, so the steps are counted)."""
    model = _sharp_model()
    call = CALLS[name]
    fast_steps: list[int] = []
    real_step = FastDecoder.step
    monkeypatch.setattr(
        FastDecoder, "step", lambda self, t: fast_steps.append(1) or real_step(self, t)
    )
    default = call(model, generator=_seeded())
    assert len(fast_steps) == 7
    monkeypatch.undo()
    explicit = call(model, temperature=1.0, decoder="auto", generator=_seeded())
    assert _tokens(default) == _tokens(explicit)
    for other in (0.0, 2.0):
        drawn = call(model, temperature=other, generator=_seeded())
        assert _tokens(default) != _tokens(drawn), f"temperature {other} drew the same"


@pytest.mark.parametrize("name", [*CALLS, "Continuation.sample"])
def test_every_generation_draws_through_the_one_loop(monkeypatch, name):
    """generate, the streams, the batches and a Continuation draw every token through
    `sample_tokens` (one call each), so they cannot drift apart."""
    calls = []
    real = generation.sample_tokens

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "sample_tokens", counted)
    monkeypatch.setattr(continuation, "sample_tokens", counted, raising=False)
    model = tiny_model().eval()
    if name in CALLS:
        tokens = _tokens(CALLS[name](model, temperature=0.0))
    else:
        cont = continuation.Continuation(model)
        cont.feed([3, 1])
        tokens = list(cont.sample(8, temperature=0.0))
    assert calls == [1] and len(tokens) >= 8


def test_the_model_knows_nothing_of_generation():
    """Generation takes a model: `BDH` has none of the generation functions as methods, and
    model/bdh.py imports no module that imports it back, not even for types (no circle in
    model/: sampling, decoders and activity import BDH, bdh.py none of them)."""
    for name in CALLS:
        assert not hasattr(BDH, name), name
    paths = modules()
    bdh = "bdh_train.model.bdh"
    back = sorted(
        found.target
        for found in imports(paths[bdh])
        if found.target in paths and bdh in {i.target for i in imports(paths[found.target])}
    )
    assert back == [], f"model/bdh.py imports {back}, which import it back"


def test_sample_next_token_defaults_to_temperature_1():
    logits = torch.randn(4, 32, generator=_seeded(1))
    draws = [generation.sample_next_token(logits, generator=_seeded(s)) for s in range(6)]
    ones = [generation.sample_next_token(logits, 1.0, generator=_seeded(s)) for s in range(6)]
    hot = [generation.sample_next_token(logits, 8.0, generator=_seeded(s)) for s in range(6)]
    assert torch.equal(torch.stack(draws), torch.stack(ones))
    assert not torch.equal(torch.stack(draws), torch.stack(hot))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", ["1e-300", "tiny/2", "2 tiny", "1e30 tiny"])
def test_a_temperature_near_0_draws_the_largest_logit(dtype, scale):
    """1e-300 is 0 in float32 (a Python float that is not 0); tiny is the dtype's smallest
    normal number, and just above it logits over the temperature overflow. Each draws the
    row's largest logit, as temperature 0 does, not from nan."""
    tiny = torch.finfo(dtype).tiny
    temperature = {"1e-300": 1e-300, "tiny/2": tiny / 2, "2 tiny": 2 * tiny}.get(scale, 1e30 * tiny)
    logits = (torch.randn(5, 40, generator=_seeded(2)) * 20).to(dtype)
    greedy = logits.argmax(dim=-1)
    for seed in range(4):
        drawn = generation.sample_next_token(logits, temperature, generator=_seeded(seed))
        assert torch.equal(drawn, greedy), (temperature, seed)
        top = generation.sample_next_token(logits, temperature, 3, generator=_seeded(seed))
        assert torch.equal(top, greedy), (temperature, seed)


def test_make_decoder_defaults_to_the_fast_one_where_it_applies():
    model = tiny_model().eval()
    assert isinstance(decoders.make_decoder(model, model.init_state(1)), FastDecoder)
    summary = tiny_model(summary_memory=SummaryMemoryConfig(enabled=True, chunk_tokens=2)).eval()
    assert isinstance(decoders.make_decoder(summary, summary.init_state(1)), GenericDecoder)


@pytest.mark.parametrize("batch", [False, True], ids=["stream_generate_batch", "generate_batch"])
def test_a_batch_samples_with_its_top_k_and_generator(batch):
    """One prompt in a batch draws what it draws alone: the same generator and top-k."""
    model = tiny_model().eval()
    options = dict(temperature=1.0, top_k=3)
    alone = generation.generate(model, torch.tensor([4, 2]), 10, generator=_seeded(), **options)
    if batch:
        got = generation.generate_batch(model, [[4, 2]], 10, generator=_seeded(), **options)[0]
    else:
        steps = generation.stream_generate_batch(
            model, [[4, 2]], 10, generator=_seeded(), **options
        )
        got = torch.cat([torch.tensor([4, 2]), torch.cat(list(steps))])
    assert got.tolist() == alone.tolist()
    wide = generation.generate(
        model, torch.tensor([4, 2]), 10, generator=_seeded(), temperature=1.0
    )
    assert wide.tolist() != alone.tolist(), "top-k 3 drew what all 32 tokens draw"


STOP_PROMPTS = [[2, 8], [6]]


def _row_1_stop(model, new_tokens: int) -> tuple[list[torch.Tensor], int]:
    """(STOP_PROMPTS generated greedily without stops, row 1's first new token): a stop that
    ends row 1 at once and that row 0 never draws."""
    free = generation.generate_batch(model, STOP_PROMPTS, new_tokens, temperature=0)
    stop = int(free[1][1])
    assert stop not in free[0].tolist()
    return free, stop


def test_stopped_rows_are_padded_with_0_by_default():
    model = tiny_model(torch.float64).eval()
    prompts = STOP_PROMPTS
    free, stop = _row_1_stop(model, 4)
    steps = list(generation.stream_generate_batch(model, prompts, 4, 0.0, stop_tokens=[stop]))
    assert [int(step[0]) for step in steps] == free[0][2:].tolist()
    assert [int(step[1]) for step in steps] == [stop, 0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_prompts_of_any_integer_dtype_generate_long_tokens(dtype):
    model = tiny_model().eval()
    prompts = [[3, 1, 4], [1]]
    want = generation.generate_batch(model, prompts, 5, temperature=0)
    got = generation.generate_batch(
        model, [torch.tensor(p, dtype=dtype) for p in prompts], 5, temperature=0
    )
    for row_got, row_want in zip(got, want, strict=True):
        assert row_got.dtype == torch.long and row_got.tolist() == row_want.tolist()
    steps = list(
        generation.stream_generate_batch(model, [torch.tensor(p, dtype=dtype) for p in prompts], 3)
    )
    assert all(step.dtype == torch.long for step in steps)


def test_n_new_tokens_take_n_minus_1_steps(monkeypatch):
    """The last token is yielded without reading it: a stream of n tokens steps n - 1 times."""
    model = tiny_model().eval()
    steps: list[int] = []
    real_step = FastDecoder.step
    monkeypatch.setattr(FastDecoder, "step", lambda self, t: steps.append(1) or real_step(self, t))
    for count in (1, 5):
        steps.clear()
        assert (
            len(list(generation.stream_generate(model, torch.tensor([1, 2]), count, 0.0))) == count
        )
        assert len(steps) == count - 1
        steps.clear()
        assert (
            len(list(generation.stream_generate_batch(model, [[1, 2], [3]], count, 0.0))) == count
        )
        assert len(steps) == count - 1


@pytest.mark.parametrize(
    "name", ["generate", "stream_generate", "generate_batch", "stream_generate_batch"]
)
def test_each_call_steps_with_the_decoder_asked_for(monkeypatch, name):
    model = tiny_model().eval()
    fast_steps: list[int] = []
    real_step = FastDecoder.step
    monkeypatch.setattr(
        FastDecoder, "step", lambda self, t: fast_steps.append(1) or real_step(self, t)
    )
    for decoder, want in (("generic", 0), ("fast", 7)):
        fast_steps.clear()
        CALLS[name](model, temperature=0.0, decoder=decoder)
        assert len(fast_steps) == want, decoder


def test_no_new_tokens_give_back_the_prompt():
    model = tiny_model().eval()
    for prompt in (torch.tensor([3, 1]), torch.tensor([[3, 1], [2, 2]])):
        assert torch.equal(generation.generate(model, prompt, 0), prompt)
    rows = generation.generate_batch(model, [[3, 1], [2]], 0)
    assert [row.tolist() for row in rows] == [[3, 1], [2]]
    assert all(row.dtype == torch.long for row in rows)


def test_rows_are_cut_only_when_one_stops(monkeypatch):
    """The batch is narrowed (its state rows copied) only at a step where a row stopped."""
    model = tiny_model(torch.float64).eval()
    prompts = STOP_PROMPTS
    _, stop = _row_1_stop(model, 5)
    cuts: list[list[int]] = []
    real = FastDecoder.keep_rows
    monkeypatch.setattr(
        FastDecoder, "keep_rows", lambda self, rows: cuts.append(rows.tolist()) or real(self, rows)
    )
    generation.generate_batch(model, prompts, 5, temperature=0)
    assert cuts == []
    generation.generate_batch(model, prompts, 5, temperature=0, stop_tokens=[stop])
    assert cuts == [[0]]


def test_bad_batch_prompts_get_the_whole_message():
    model = tiny_model().eval()
    start = "generate_batch needs at least one prompt, each of at least one token"
    with pytest.raises(ValueError, match=f"^{re.escape(start)}$"):
        generation.generate_batch(model, [], 2)
    with pytest.raises(ValueError, match=f"^{re.escape(start)}; prompts \\[1\\] are empty$"):
        generation.generate_batch(model, [[1], []], 2)


def test_unsupported_models_are_named_exactly():
    cases = (
        (
            tiny_model(summary_memory=SummaryMemoryConfig(enabled=True, chunk_tokens=2)),
            "the summary memory",
        ),
        (tiny_model(quant=QuantConfig(enable=True)), "a quantized model"),
        (tiny_model(dropout=0.1).train(), "dropout in train mode"),
        (tiny_model(torch.bfloat16), "dtype torch.bfloat16"),
    )
    for model, reason in cases:
        assert decoders.fast_decoder_unsupported(model) == reason
    assert decoders.fast_decoder_unsupported(tiny_model(dropout=0.0).train()) is None


# ------------------------------------------------------------------- the fast decoder
def _steps(decoder, model, tokens: list[list[int]]) -> torch.Tensor:
    return torch.stack([model.logits_from_hidden(decoder.step(torch.tensor(t))) for t in tokens])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_the_fast_decoder_on_a_state_that_read_nothing(monkeypatch, dtype, position):
    """Built on `init_state` (no layer has a state yet) it starts from zero states, as the
    generic step does; 7 steps fold twice."""
    monkeypatch.setattr(decoders, "FOLD_TOKENS", 3)
    model = tiny_model(dtype, position=position).eval()
    tokens = [[i % 5, (3 * i) % 7] for i in range(7)]
    with torch.no_grad():
        fast = _steps(FastDecoder(model, model.init_state(2), static=False), model, tokens)
        generic = _steps(GenericDecoder(model, model.init_state(2)), model, tokens)
    assert_close(fast, generic, rtol={torch.float32: 1e-5, torch.float64: 1e-10}[dtype])


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shape"])
def test_one_row_steps_at_its_own_rope_phase(monkeypatch, static):
    """Batch 1 takes its rope rotation by the row's position (the eager step without a
    per-row gather): the logits of 11 steps past a prompt agree with the generic step's
    (fp32 1e-5 over all of them) while the table of 3 positions moves on; the table is
    refilled only when the row leaves it."""
    monkeypatch.setattr(decoders, "ROPE_TABLE_TOKENS", 3)
    monkeypatch.setattr(decoders, "FOLD_TOKENS", 4)
    model = tiny_model().eval()
    fills: list[int] = []
    real_fill = FastDecoder._fill_rope_table
    monkeypatch.setattr(
        FastDecoder, "_fill_rope_table", lambda self: fills.append(1) or real_fill(self)
    )
    tokens = [[(5 * i + 2) % 11] for i in range(11)]
    with torch.no_grad():
        states = []
        for _ in range(2):
            state = model.init_state(1)
            model.forward_hidden(torch.tensor([[7, 3, 9, 1]]), state)
            states.append(state)
        fast = _steps(FastDecoder(model, states[0], static=static), model, tokens)
        generic = _steps(GenericDecoder(model, states[1]), model, tokens)
    assert_close(fast, generic, rtol=1e-5)
    # positions 4..14 step; the table holds 3 positions from the row's: filled at 4, 7, 10, 13
    assert len(fills) == 4


def test_the_fixed_shape_step_runs_where_asked_and_is_off_on_the_cpu(monkeypatch):
    model = tiny_model().eval()
    runs: list[int] = []
    real = FastDecoder._static_layers
    monkeypatch.setattr(FastDecoder, "_static_layers", lambda self: runs.append(1) or real(self))
    with torch.no_grad():
        for static, want in ((None, 0), (False, 0), (True, 3)):
            runs.clear()
            decoder = FastDecoder(model, model.init_state(2), static=static)
            assert decoder.static is bool(want)
            _steps(decoder, model, [[1, 2]] * 3)
            assert len(runs) == want, static


# ------------------------------------------------------------- summary events in a batch
def _write_gated_model(monkeypatch) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A float64 model of 4 tokens whose summary memory has a write gate, and the list that
    records the event mask each of its `forward_hidden` calls is passed, in order."""
    memory = SummaryMemoryConfig(enabled=True, chunk_tokens=3, write_gate=True, residual_scale=1.0)
    model = tiny_model(torch.float64, vocab_size=4, summary_memory=memory).eval()
    passed: list[torch.Tensor] = []
    forward_hidden = model.forward_hidden

    def recording(idx, *args, summary_event_mask=None, **kwargs):
        passed.append(summary_event_mask)
        return forward_hidden(idx, *args, summary_event_mask=summary_event_mask, **kwargs)

    monkeypatch.setattr(model, "forward_hidden", recording)
    return model, passed


def test_a_batch_marks_each_rows_summary_events(monkeypatch):
    """A write-gated summary memory in a batch (the generic decoder): every call is passed
    the events of the tokens it reads, found with each row's own history (a 2-token
    trigger reaches one token back), also after a row stopped and left the batch. The
    masks passed are those of each row's whole sequence."""
    trigger = SummaryEventTrigger(sequence=(2, 2))
    model, passed = _write_gated_model(monkeypatch)
    prompts = [[3, 0, 1, 2], [1], [2, 2, 0]]
    free = generation.generate_batch(model, prompts, 6, 0.0, summary_events=trigger)
    stop = int(free[2][3])  # row 2's first new token, which rows 0 and 1 never draw
    assert all(stop not in free[r][len(prompts[r]) :].tolist() for r in (0, 1))
    passed.clear()
    out = generation.generate_batch(
        model, prompts, 6, 0.0, stop_tokens=[stop], summary_events=trigger
    )
    want = [trigger.mask(row.view(1, -1))[0] for row in out]
    assert sum(int(w[len(p) :].sum()) for w, p in zip(want, prompts, strict=True)) >= 6
    for row, prompt in enumerate(prompts):  # each prompt is read alone
        assert torch.equal(passed[row], want[row][: len(prompt)].view(1, -1))
    for k, mask in enumerate(passed[len(prompts) :]):  # step k + 1 reads new token k
        stepped = [
            r
            for r, p in enumerate(prompts)
            if k < len(out[r]) - len(p) and int(out[r][len(p) + k]) != stop
        ]
        expected = torch.stack([want[r][len(prompts[r]) + k] for r in stepped])
        assert torch.equal(mask.view(-1), expected), f"step {k + 1}"
    assert len(passed) == len(prompts) + 5


def test_one_stream_marks_an_event_that_spans_the_prompts_end(monkeypatch):
    """The prompt's last tokens are the first step's history: a 2-token trigger whose first
    token ends the prompt is an event at the first new token."""
    trigger = SummaryEventTrigger(sequence=(2, 2))
    model, passed = _write_gated_model(monkeypatch)
    prompt = torch.tensor([[3, 0, 1, 2]])
    out = generation.generate(model, prompt, 4, 0.0, summary_events=trigger)
    want = trigger.mask(out)
    assert out[0, 4] == 2 and bool(want[0, 4]), "the first new token does not end an event"
    assert torch.equal(torch.cat(passed, dim=1), want[:, :-1])


def test_the_history_before_a_short_prompt_is_no_token():
    """A prompt shorter than the events' history leaves -1 (no token, matching no trigger)
    before it, never a token id."""
    model = tiny_model(torch.float64, vocab_size=4).eval()
    trigger = SummaryEventTrigger(sequence=(1, 0, 2))
    _, _, recent = generation._read_prompt(model, torch.tensor([[0]]), trigger)
    assert recent.tolist() == [[-1, 0]]
    _, _, recent = generation._read_prompt(model, torch.tensor([[3, 1, 0]]), trigger)
    assert recent.tolist() == [[1, 0]]


def test_the_generic_decoder_without_recent_tokens_starts_the_history_there(monkeypatch):
    """Built with summary events and no recent tokens, the generic decoder finds events as if
    the row began at its first step: its history starts as -1 (no token), so a 2-token
    trigger cannot reach before it, and fills with the tokens it reads."""
    trigger = SummaryEventTrigger(sequence=(1, 2))
    model, passed = _write_gated_model(monkeypatch)
    tokens = torch.tensor([[2, 1, 2, 3, 1, 2]])
    with torch.no_grad():
        decoder = GenericDecoder(model, model.init_state(1), trigger)
        assert decoder.recent is not None and decoder.recent.tolist() == [[-1]]
        for t in range(tokens.shape[1]):
            decoder.step(tokens[:, t])
    assert trigger.mask(tokens).tolist() == [[False, False, True, False, False, True]]
    assert torch.equal(torch.cat(passed, dim=1), trigger.mask(tokens))
