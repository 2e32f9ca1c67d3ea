"""Summary memory: a running summary of past chunks of a layer's input, added to its later
tokens.

Per enabled layer and row, the layer input u is cut into chunks of C = chunk_tokens tokens,
aligned to the row's ABSOLUTE position (chunk k holds positions [kC, kC + C)). The memory m
holds the summary of the chunks completed so far (absent before the first one completes):

    branch_t = u_t + residual_scale * m        (m as it was when t's chunk began; 0 if absent)
    at the end of a chunk, s = mean of its u:
        updated = decay * m + update_scale * s       (update_scale * s when m is absent)
        surprise gate (threshold > 0, m present):
            r = relu((mean_D |s - m| - threshold) * sharpness),  g = r / (r + 1)
            updated = m + g * (updated - m)
        write gate (write_gate): hits = summary events in the chunk, gate = hits / (hits + 1e-6)
            updated = m * (1 - gate) + updated * gate       (absent m counts as 0)
        m = updated

The layer then runs on the branch instead of u. Since chunks follow absolute positions, a
chunk may span calls: the carry holds m and the sum and event count of the unfinished chunk
(its token count is position mod C), so a sequence split into calls anywhere equals one call,
and generation costs O(1) per token. m is present for a row once its position has passed C.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from bdh_train.model.config import SummaryMemoryConfig

WRITE_GATE_EPS = 1e-6
"""gate = hits / (hits + WRITE_GATE_EPS): one event opens the gate almost fully."""


NO_TOKEN = -1
"""Stands in a summary-event history for positions before the row's sequence began (it
matches no trigger)."""


class SummaryEvents(Protocol):
    """Finds summary events in tokens (the data layer's write trigger is one); generation
    uses it to mark the events in the tokens it produces."""

    @property
    def history_len(self) -> int:
        """How many tokens before the inputs an event may reach back to."""
        ...

    def mask(self, inputs: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] events of inputs [B, T]; history [B, history_len] holds the tokens before
        them (NO_TOKEN where there were none)."""
        ...


class SummaryCarry(NamedTuple):
    """What one layer's summary memory carries between calls (rows first)."""

    memory: torch.Tensor
    """m [B, 1, 1, D]; zeros where absent."""
    chunk_sum: torch.Tensor
    """Sum of u over the unfinished chunk's tokens so far [B, 1, 1, D]."""
    chunk_hits: torch.Tensor
    """Summary events in the unfinished chunk so far [B] (long)."""


def summary_branch(
    u: torch.Tensor,
    carry: SummaryCarry | None,
    position: torch.Tensor,
    cfg: SummaryMemoryConfig,
    event_mask: torch.Tensor | None = None,
    same_phase_fast_path: bool = True,
) -> tuple[torch.Tensor, SummaryCarry]:
    """(branch [B, 1, T, D], carry after the call) for the layer input u [B, 1, T, D].

    `carry` None is a fresh memory; `position` [B] is each row's absolute position at the
    call's first token; `event_mask` [B, T] (nonzero = event) is read only with the write gate.
    When every row is at the same place in its chunk (the usual case; one host sync finds
    out), tokens go to and from chunks by reshaping; otherwise, or with
    `same_phase_fast_path=False`, by scatter and gather (the general twin).
    """
    batch, _, seq_len, dim = u.shape
    c = cfg.chunk_tokens
    x = u.reshape(batch, seq_len, dim)
    if carry is None:
        zeros = x.new_zeros(batch, dim)
        carry = SummaryCarry(zeros, zeros, torch.zeros(batch, dtype=torch.long, device=x.device))
    memory = carry.memory.reshape(batch, dim)
    phase = position.to(x.device) % c  # tokens of the unfinished chunk already seen
    # chunk_of[b, t]: the call-relative chunk of token t; chunk 0 is the unfinished one.
    chunk_of = (phase.unsqueeze(1) + torch.arange(seq_len, device=x.device)) // c
    n_chunks = (seq_len + c - 1) // c + 1  # enough for every phase, trailing chunk included
    shared_phase = None
    if same_phase_fast_path:
        phases = phase.unique()
        shared_phase = int(phases[0]) if phases.numel() == 1 else None
    if shared_phase is None:
        index = chunk_of.unsqueeze(-1).expand(batch, seq_len, dim)
        sums = x.new_zeros(batch, n_chunks, dim).scatter_add(1, index, x)
    else:  # pad the unfinished chunk's seen tokens and the trailing chunk, then reshape
        padded = F.pad(x, (0, 0, shared_phase, n_chunks * c - shared_phase - seq_len))
        sums = padded.view(batch, n_chunks, c, dim).sum(2)
    sums = torch.cat([sums[:, :1] + carry.chunk_sum.reshape(batch, 1, dim), sums[:, 1:]], dim=1)
    counts = torch.zeros(batch, n_chunks, dtype=torch.long, device=x.device)
    counts = counts.scatter_add(1, chunk_of, torch.ones_like(chunk_of))
    counts[:, 0] += phase
    hits = None
    if cfg.write_gate:
        hits = torch.zeros(batch, n_chunks, dtype=torch.long, device=x.device)
        if event_mask is not None:
            events = (event_mask.to(x.device) != 0).long()
            hits = hits.scatter_add(1, chunk_of, events)
        hits[:, 0] += carry.chunk_hits.to(x.device)
    first_chunk = position.to(x.device) // c  # absolute index of call-relative chunk 0

    before = []  # m as each call-relative chunk begins
    for j in range(n_chunks):
        before.append(memory)
        complete = counts[:, j] == c
        if (j + 1) * c > seq_len + c - 1:
            continue  # no row can complete this chunk inside the call (phase <= C - 1)
        s = sums[:, j] / c
        updated = cfg.state_decay * memory + cfg.state_update_scale * s
        if cfg.surprise_gate_threshold > 0:
            distance = (s - memory).abs().mean(-1, keepdim=True)
            r = F.relu((distance - cfg.surprise_gate_threshold) * cfg.surprise_gate_sharpness)
            present = (first_chunk + j >= 1).unsqueeze(-1)
            g = torch.where(present, r / (r + 1), torch.ones_like(r))
            updated = memory + g * (updated - memory)
        if hits is not None:
            h = hits[:, j].to(x.dtype).unsqueeze(-1)
            gate = h / (h + WRITE_GATE_EPS)
            updated = memory * (1 - gate) + updated * gate
        memory = torch.where(complete.unsqueeze(-1), updated, memory)

    per_chunk = torch.stack(before, dim=1)  # [B, n_chunks, D]
    if shared_phase is None:
        per_token = per_chunk.gather(1, index)
    else:
        spread = per_chunk.unsqueeze(2).expand(batch, n_chunks, c, dim)
        spread = spread.reshape(batch, n_chunks * c, dim)
        per_token = spread[:, shared_phase : shared_phase + seq_len]
    branch = (x + cfg.residual_scale * per_token).view(batch, 1, seq_len, dim)

    last = ((phase + seq_len) // c).view(batch, 1, 1)  # the chunk left unfinished
    chunk_sum = sums.gather(1, last.expand(batch, 1, dim))
    chunk_hits = (
        carry.chunk_hits if hits is None else hits.gather(1, last.view(batch, 1)).view(batch)
    )
    new_carry = SummaryCarry(
        memory.view(batch, 1, 1, dim), chunk_sum.view(batch, 1, 1, dim), chunk_hits
    )
    return branch, new_carry
