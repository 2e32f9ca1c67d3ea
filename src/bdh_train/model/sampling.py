"""Generation: a prompt is read once, PREFILL_TOKENS at a time (`read_tokens`: the state
carries one chunk to the next, so memory does not grow with the prompt), then every new token
is one recurrent step on the carried state, so a token costs the same whatever came before it.

Two decoders take the step (`model/decoders.py`): the generic one, the model's own layer
code, and the fast one, the same arithmetic with a generation's constants folded once;
`decoder='auto'` takes the fast one where it applies.

One loop samples for all of them (`sample_tokens`: one row or a batch; `Continuation`, which
carries a state between calls, drives it too). Batched generation (`stream_generate_batch`,
`generate_batch`) takes prompts of different lengths: each prompt is read on its own (exactly
as when it is generated alone), then the rows step together, each at its own position. A row
that samples one of `stop_tokens` ends there: it is removed from the batch (its state rows are
dropped, so it costs nothing afterwards) and the stream yields `pad_id` for it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from bdh_train.errors import BDHTrainError
from bdh_train.model.decoders import Decoder, make_decoder
from bdh_train.model.state import ModelState
from bdh_train.model.summary import NO_TOKEN, SummaryEvents

if TYPE_CHECKING:
    from bdh_train.model.bdh import BDH

PREFILL_TOKENS = 1024
"""Tokens of a prompt read per `forward_hidden` call (`read_tokens`): the activations of one
call are alive at a time (about 5 KB per token for a 28k-parameter model), so a prompt's
memory is that of this many tokens whatever its length."""


class NonFiniteModelError(BDHTrainError):
    """The model's weights, or the logits it gives, hold NaN or infinity: no token can be
    drawn from them."""


def nonfinite_weights(model: torch.nn.Module) -> str | None:
    """The parameters holding NaN or infinity, each with its count ('encoder (3 of 8,192
    values)'); None when every weight is finite."""
    found = []
    for name, p in model.named_parameters():
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:
            found.append(f"{name} ({bad:,} of {p.numel():,} values)")
    return ", ".join(found) if found else None


def check_finite_weights(model: torch.nn.Module, where: str) -> None:
    """NonFiniteModelError naming `where` (what the weights are, 'checkpoint RUN/...') and
    the parameters that hold NaN or infinity; nothing when every weight is finite."""
    bad = nonfinite_weights(model)
    if bad is not None:
        raise NonFiniteModelError(
            f"the weights of {where} are not finite: NaN or infinity in {bad}; nothing can be "
            "sampled from them"
        )


def check_finite_logits(model: BDH, logits: torch.Tensor) -> None:
    """NonFiniteModelError when `logits` hold NaN or infinity (one read back to the host),
    naming the model's non-finite weights where there are any."""
    if bool(torch.isfinite(logits).all()):
        return
    check_finite_weights(model, "the model")
    raise NonFiniteModelError(
        "the model's logits are not finite (NaN or infinity) although its weights are: the "
        "state it continues holds NaN or infinity, or its values overflow "
        f"{str(logits.dtype).removeprefix('torch.')}; nothing can be sampled from them"
    )


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from logits [B, V]: greedy at temperature 0, else top-k sampling."""
    if temperature < torch.finfo(logits.dtype).tiny:  # 0 in the logits' dtype: greedy
        return logits.argmax(dim=-1)
    # Shifted so that each row's largest logit is 0: where the logits over the temperature
    # overflow, the largest stays 0 and the rest become -inf (not inf - inf = nan).
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


# ---------------------------------------------------------------------------- generation
def _prompt_rows(prompt_ids: torch.Tensor) -> torch.Tensor:
    prompt = prompt_ids.unsqueeze(0) if prompt_ids.dim() == 1 else prompt_ids
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"generate needs a prompt of at least one token ([T] or [B, T]), got shape "
            f"{tuple(prompt_ids.shape)}"
        )
    return prompt


def read_tokens(
    model: BDH,
    state: ModelState,
    ids: torch.Tensor,
    summary_events: SummaryEvents | None = None,
    recent: torch.Tensor | None = None,
    executor: str | None = None,
    chunk_tokens: int | None = PREFILL_TOKENS,
    on_hidden: Callable[[int, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read token ids [B, T] (T >= 1, any integer dtype) into `state`, `chunk_tokens` at a
    time (None: in one call); -> (last token's hidden [B, D], the last history_len tokens).
    `on_hidden(start, hidden)` is given each chunk's hidden states [B, t, D] (tokens start
    to start + t), for a caller that scores every token (bdh_train.evals.scoring).

    The state carries everything from one chunk to the next, so the chunks read what one
    call reads (tests/model/test_prefill.py) and the activations of one chunk at a time are
    alive: memory does not grow with T. `recent` [B, history_len] holds the tokens read
    before `ids` (NO_TOKEN before the start; None: the rows start here); with
    `summary_events` each chunk's events are found after those of the tokens before it.
    """
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive or None, got {chunk_tokens}")
    batch, length = ids.shape
    device = model.embed.weight.device
    if summary_events is not None and recent is None:
        recent = torch.full(
            (batch, summary_events.history_len), NO_TOKEN, dtype=torch.long, device=device
        )
    step = length if chunk_tokens is None else chunk_tokens
    hidden = None
    for start in range(0, length, step):
        part = ids[:, start : start + step].to(device=device, dtype=torch.long)
        events = None
        if summary_events is not None:
            assert recent is not None  # set above
            keep = recent.shape[1]
            events = summary_events.mask(part, recent if keep else None)
            if keep:
                recent = torch.cat([recent, part], dim=1)[:, -keep:]
        out = model.forward_hidden(part, state, executor=executor, summary_event_mask=events)
        if on_hidden is not None:
            on_hidden(start, out)
        hidden = out[:, -1]
    if hidden is None:
        raise ValueError(f"read_tokens needs at least one token, got shape {tuple(ids.shape)}")
    return hidden, recent


def _read_prompt(
    model: BDH, prompt: torch.Tensor, summary_events: SummaryEvents | None
) -> tuple[ModelState, torch.Tensor, torch.Tensor | None]:
    """(state after the prompt [B, T], last token's hidden [B, D], last history_len tokens)."""
    state = model.init_state(prompt.shape[0])
    hidden, recent = read_tokens(model, state, prompt, summary_events)
    return state, hidden, recent


def sample_tokens(
    model: BDH,
    decoder: Decoder,
    hidden: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    read_last: bool = False,
    on_read: Callable[[torch.Tensor], None] | None = None,
) -> Generator[torch.Tensor, None, None]:
    """The sampling loop of every generation: yield new tokens [B] one step at a time from
    rows read so far (`hidden` [B, D], their last token's output; `decoder` steps their state).

    Each token is read back in (one `decoder` step, `on_read` given the new hidden [B, D])
    before the next is drawn, and after the last one only with `read_last`; a caller that
    stops iterating leaves the token it was given unread. A row that samples a token of
    `stop_tokens` yields it and is done: it leaves the batch (`decoder.keep_rows`) and yields
    `pad_id` from then on; the loop ends after `max_new_tokens` steps or when every row is
    done. It sets no grad mode: run it under the one the state was read in (inference_mode
    or no_grad)."""
    device = hidden.device
    rows = hidden.shape[0]
    stops = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long, device=device)
    active = torch.arange(rows, device=device)  # original index of each stepped row
    for index in range(max_new_tokens):
        logits = model.logits_from_hidden(hidden).float()
        if index == 0:
            check_finite_logits(model, logits)
        token = sample_next_token(logits, temperature, top_k, generator)
        if active.shape[0] == rows:
            out = token
        else:
            out = torch.full((rows,), pad_id, dtype=torch.long, device=device)
            out[active] = token
        yield out
        if index + 1 == max_new_tokens and not read_last:
            return
        going = ~torch.isin(token, stops) if stops.numel() else None
        if going is not None and not bool(going.all()):
            if not bool(going.any()):
                return
            keep = going.nonzero().squeeze(1)
            decoder.keep_rows(keep)
            active, token = active[keep], token[keep]
        hidden = decoder.step(token)
        if on_read is not None:
            on_read(hidden)


@torch.inference_mode()
def stream_generate(
    model: BDH,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    summary_events: SummaryEvents | None = None,
    decoder: str = "auto",
) -> Iterator[torch.Tensor]:
    """Yield new tokens [B] one at a time for prompts [B, T] (or one prompt [T]).

    The prompt is read once with the model's executor, PREFILL_TOKENS at a time
    (`read_tokens`); then each token costs one recurrent step (`decoder`: see DECODERS) of
    `sample_tokens`. temperature 0 means greedy. `summary_events` marks the summary events of
    the prompt and of each new token (for a summary memory with a write gate; without it
    such a memory is never written).
    """
    prompt = _prompt_rows(prompt_ids)
    state, hidden, recent = _read_prompt(model, prompt, summary_events)
    stepper = make_decoder(model, state, decoder, summary_events, recent)
    yield from sample_tokens(model, stepper, hidden, max_new_tokens, temperature, top_k, generator)


def generate(
    model: BDH,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    summary_events: SummaryEvents | None = None,
    decoder: str = "auto",
) -> torch.Tensor:
    """Prompt followed by `max_new_tokens` sampled tokens ([B, T + new], or [T + new])."""
    prompt = _prompt_rows(prompt_ids)
    new = list(
        stream_generate(
            model, prompt, max_new_tokens, temperature, top_k, generator, summary_events, decoder
        )
    )
    out = torch.cat([prompt, torch.stack(new, dim=1)], dim=1) if new else prompt
    return out[0] if prompt_ids.dim() == 1 else out


@torch.inference_mode()
def stream_generate_batch(
    model: BDH,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    summary_events: SummaryEvents | None = None,
    decoder: str = "auto",
) -> Iterator[torch.Tensor]:
    """Yield new tokens [B] (one per prompt) one step at a time, for prompts of any lengths.

    Each prompt is read alone (as `stream_generate` reads it), then the rows step together,
    each at its own position (`sample_tokens`). A row that samples a token of `stop_tokens`
    yields it and is done: it leaves the batch, and yields `pad_id` from then on. The stream
    ends after `max_new_tokens` steps or when every row is done. Greedy rows (temperature 0)
    get exactly the tokens they get alone; sampled rows share `generator`, so their draws
    depend on the batch.
    """
    device = model.embed.weight.device
    rows = [torch.as_tensor(p, dtype=torch.long, device=device).reshape(-1) for p in prompts]
    empty = [i for i, row in enumerate(rows) if row.numel() == 0]
    if not rows or empty:
        raise ValueError(
            "generate_batch needs at least one prompt, each of at least one token"
            + (f"; prompts {empty} are empty" if empty else "")
        )
    read = [_read_prompt(model, row.view(1, -1), summary_events) for row in rows]
    state = ModelState.concat([r[0] for r in read])
    hidden = torch.cat([r[1] for r in read])
    recents = [r[2] for r in read if r[2] is not None]  # each row's, with summary_events
    recent = None if summary_events is None else torch.cat(recents)
    stepper = make_decoder(model, state, decoder, summary_events, recent)
    yield from sample_tokens(
        model, stepper, hidden, max_new_tokens, temperature, top_k, generator, stop_tokens, pad_id
    )


def generate_batch(
    model: BDH,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    stop_tokens: Sequence[int] = (),
    summary_events: SummaryEvents | None = None,
    decoder: str = "auto",
) -> list[torch.Tensor]:
    """Per prompt: the prompt followed by its new tokens, up to and including its stop token
    (1-D long tensors of each row's own length); see `stream_generate_batch`."""
    device = model.embed.weight.device
    rows = [torch.as_tensor(p, dtype=torch.long, device=device).reshape(-1) for p in prompts]
    new: list[list[torch.Tensor]] = [[] for _ in rows]
    done = [False] * len(rows)
    stops = set(stop_tokens)
    stream = stream_generate_batch(
        model,
        rows,
        max_new_tokens,
        temperature,
        top_k,
        generator,
        stop_tokens,
        summary_events=summary_events,
        decoder=decoder,
    )
    for step_tokens in stream:
        for i, token in enumerate(step_tokens.tolist()):
            if not done[i]:
                new[i].append(token)
                done[i] = token in stops
    return [
        torch.cat([row, torch.tensor(tokens, dtype=torch.long, device=device)])
        for row, tokens in zip(rows, new, strict=True)
    ]
