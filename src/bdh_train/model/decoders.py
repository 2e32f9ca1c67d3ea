"""The per-token step of generation, two ways that agree (tests/model/test_fast_decode.py):

* `GenericDecoder`: `BDH.forward_hidden(token, state, executor="recurrent")`, the model's own
  layer code; every model feature works. The slow, obviously-correct twin.
* `FastDecoder`: the same arithmetic with what does not change during a generation folded
  once (the encoder as one [D, H*N] matrix, rope rotations from a table of phases, alibi
  decay factors), each layer a handful of torch ops writing the state in place; on CUDA at
  fixed shapes, captured once as a CUDA graph. `fast_decoder_unsupported` names what it does
  not cover, and `make_decoder` picks one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from bdh_train.model.positions import rope_cos_sin
from bdh_train.model.state import ModelState
from bdh_train.model.summary import NO_TOKEN, SummaryEvents

if TYPE_CHECKING:
    from bdh_train.model.bdh import BDH

DECODERS = ("auto", "fast", "generic")
"""How a generation takes its per-token steps: the fast decoder where it applies ('auto'),
always the fast one ('fast': ValueError where it does not apply) or the generic one."""

FOLD_TOKENS = 16
"""Tokens the fast decoder keeps pending before folding them into the state: a token's step
reads the state once (instead of reading it and writing it), and every FOLD_TOKENS tokens one
GEMM per layer writes them all. Each step also reads the pending keys, so fewer of them cost
more folds and less reading: on the CPU (config L4 D128 H4 N512, fp32) 16 took 0.97 of 32's
time per step at batch 16 (64 and 8-24 measured too) and the same within noise at batch 1."""

ROPE_TABLE_TOKENS = 4096
"""Positions of rope phases computed at once; the table moves on when the rows pass its end."""


class GenericDecoder:
    """One token per row through `forward_hidden(..., executor="recurrent")` on `state`.

    `summary_events` marks the summary events of each new token; `recent` [B, history_len]
    holds the tokens read before it (NO_TOKEN before the start; None: the rows start here)."""

    def __init__(
        self,
        model: BDH,
        state: ModelState,
        summary_events: SummaryEvents | None = None,
        recent: torch.Tensor | None = None,
    ) -> None:
        self.model, self.state, self.events = model, state, summary_events
        if summary_events is not None and recent is None:
            recent = torch.full(
                (state.batch_size, summary_events.history_len),
                NO_TOKEN,
                dtype=torch.long,
                device=model.embed.weight.device,
            )
        self.recent = recent

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Read tokens [B] (one per row); return their last-layer hidden states [B, D]."""
        token = tokens.view(-1, 1)
        events = None
        if self.events is not None:
            recent = self.recent
            if recent is not None and recent.shape[1] == 0:
                recent = None
            events = self.events.mask(token, recent)
            if recent is not None:
                self.recent = torch.cat([recent, token], dim=1)[:, 1:]
        hidden = self.model.forward_hidden(
            token, self.state, executor="recurrent", summary_event_mask=events
        )
        return hidden[:, -1]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not listed in `rows` (long indices, in the order kept)."""
        self.state.select_rows_(rows)
        if self.recent is not None:
            self.recent = self.recent.index_select(0, rows)


def fast_decoder_unsupported(model: BDH) -> str | None:
    """Why `FastDecoder` cannot step this model (None when it can)."""
    c = model.config
    if c.summary_memory.enabled:
        return "the summary memory"
    if c.token_shift:
        return "the token shift"
    if model.quantizer is not None:
        return "a quantized model"
    if model.training and c.dropout > 0:
        return "dropout in train mode"
    if model.embed.weight.dtype not in (torch.float32, torch.float64):
        return f"dtype {model.embed.weight.dtype}"
    if c.language_head.type != "token":
        return f"the {c.language_head.type!r} head"
    return None


def pending_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q . key [B, H, K] of queries q [B, H, N] with each of the pending keys [B, H, K, N].

    Taken as the row q times the keys' transpose: on the CPU (config L4 D128 H4 N512, 32
    pending slots) that product ran 1.8x faster at batch 16 and 1.4x at batch 1 than the keys
    times q as a column, the same sums."""
    b, h, k, n = keys.shape
    return torch.bmm(q.reshape(b * h, 1, n), keys.reshape(b * h, k, n).mT).view(b, h, k)


def reads_state_by_rows(rho: torch.Tensor) -> bool:
    """Whether the fast decoder reads the state q.rho (of rho's device and dtype) as one
    weighted sum of rho's rows per (row, head) (`F.embedding_bag`) instead of a batched
    row-times-matrix product (`bmm`).

    On the CPU in float32 the row sums run at the memory's bandwidth: for config L4 D128 H4
    N512 they took 0.6-1.0 ms against the product's 2.35 ms at batch 16 (4 layers), and 0.05
    against 0.16 ms at batch 1. In float64 the row sums were slower (4.5 against 3.1 ms);
    CUDA keeps the product."""
    return rho.device.type == "cpu" and rho.dtype == torch.float32


class FastDecoder:
    """The generic step's arithmetic with the per-generation constants folded once.

    It takes over `state`: the rho of every layer moves into one [L, B, H, N, D] buffer
    (state.rho[l] are views of it) that is updated in place every FOLD_TOKENS steps, and
    state.position advances by one per step; state.rho includes every token read after
    `flush()`. Build it after the prompt is read; call `step` under torch.no_grad or
    torch.inference_mode. The weights are read when it is built: rebuild it after changing them.
    """

    def __init__(self, model: BDH, state: ModelState, static: bool | None = None) -> None:
        reason = fast_decoder_unsupported(model)
        if reason is not None:
            raise ValueError(f"the fast decoder does not support {reason}; use the generic one")
        c = model.config
        self.heads, self.dim, self.neurons = h, d, n = c.n_head, c.n_embd, c.n_neurons
        weight = model.embed.weight
        self.embed = weight.detach()
        self.encoder = model.encoder.detach().permute(1, 0, 2).reshape(d, h * n).contiguous()
        self.encoder_v = model.encoder_v.detach().contiguous()  # [H, D, N]
        self.decoder = model.decoder.detach().contiguous()  # [H*N, D]
        norm = model.norm
        self.norm_weight = None if norm is None else norm.weight.detach()
        self.norm_bias = None if norm is None else norm.bias.detach()
        self.norm_eps = model.norm_eps
        batch = state.batch_size
        zeros = weight.new_zeros(batch, h, n, d)
        self.rho = torch.stack([zeros if r is None else r.detach() for r in state.rho])
        self.state = state
        state.position = state.position.clone()
        # The last tokens' keys (q) and values (u) wait here, pending, until FOLD_TOKENS of them
        # are folded into rho with one GEMM per layer.
        k = self.fold_tokens = FOLD_TOKENS
        self.pending_q = weight.new_zeros(len(self.rho), batch, h, k, n)
        self.pending_v = weight.new_zeros(len(self.rho), batch, k, d)
        self.pending = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._split_layers()
        self.decay_powers = None  # [H, K + 1]: d_h^m for m = 0..K
        self.decay_powers_reversed = None  # [H, K + 1]: d_h^(K - i) for i = 0..K
        log_decay = model.log_decay()
        if log_decay is not None:
            log_decay = log_decay.detach()
            exponents = torch.arange(k + 1, dtype=torch.float64, device=weight.device)
            powers = torch.exp(log_decay.to(weight.device).unsqueeze(1) * exponents)
            self.decay_powers = powers.to(weight.dtype)
            self.decay_powers_reversed = self.decay_powers.flip(1).contiguous()
        self.rope_freqs = model.rope_freqs if c.position == "rope" else None  # [N], float64
        self.rope_table: torch.Tensor | None = None  # rotations [positions, 1, N/2], complex
        self.table_start = 0
        self._positions_known = False
        self.first_position = self.last_position = 0  # min and max of state.position
        # The fixed-shape step (`static`): every pending slot is read, weighted by row
        # `slot` of slot_weights (d^(slot - j) for slots j < slot, else 0; d = 1 without
        # decay), and the state term by d^slot; `slot` is a device counter.
        self.static = weight.device.type == "cuda" if static is None else static
        self.slot = torch.zeros(1, dtype=torch.long, device=weight.device)
        self.static_tokens = torch.zeros(batch, dtype=torch.long, device=weight.device)
        powers = weight.new_ones(h, k + 1) if self.decay_powers is None else self.decay_powers
        offsets = torch.arange(k, device=weight.device)
        earlier = offsets.view(1, k) < offsets.view(k, 1)  # [slot, j]: j < slot
        exponent = (offsets.view(k, 1) - offsets.view(1, k)).clamp_min(0)
        self.slot_weights = torch.where(
            earlier.unsqueeze(1), powers[:, exponent].permute(1, 0, 2), 0.0
        ).contiguous()  # [K, H, K]
        self.slot_decay = powers[:, :k].t().contiguous()  # [K, H]: d^slot
        self.graph: torch.cuda.CUDAGraph | None = None
        self._graph_hidden: torch.Tensor | None = None
        self._graph_warm = False
        self._capture_stream = (
            torch.cuda.Stream(weight.device) if self.static and weight.is_cuda else None
        )

    def _split_layers(self) -> None:
        """Per layer, views of rho [B, H, N, D], the pending keys [B, H, K, N] and values
        [B, K, D], taken once: a step then indexes no buffer (at batch 1 on the CPU the
        indexing was 5% of a step). state.rho are the same views of rho."""
        rho = list(self.rho.unbind(0))
        self.state.rho = list(rho)  # (a list typed Tensor | None, as ModelState's is)
        self.layers = list(
            zip(rho, self.pending_q.unbind(0), self.pending_v.unbind(0), strict=True)
        )
        # (rows, offsets) of the state read by rows: (row, head) i sums rho's rows
        # i*N .. (i+1)*N - 1, weighted by q
        self.row_sums: tuple[torch.Tensor, torch.Tensor] | None = None
        if reads_state_by_rows(self.rho):
            b, h, n = self.rho.shape[1:4]
            device = self.rho.device
            self.row_sums = (
                torch.arange(b * h * n, device=device),
                torch.arange(0, b * h * n, n, device=device),
            )

    def _rope_table_for_rows(self) -> torch.Tensor:
        """The rope table, moved on first when the rows' positions left it."""
        if not self._positions_known:  # one host sync after the rows change
            self.first_position = int(self.state.position.min())
            self.last_position = int(self.state.position.max())
            self._positions_known = True
        table = self.rope_table
        if (
            table is None
            or self.first_position < self.table_start
            or self.last_position >= self.table_start + table.shape[0]
        ):
            table = self._fill_rope_table()
        return table

    def _rope_rotation(self) -> torch.Tensor:
        """This step's rope rotation per row, broadcastable over [B, H, N/2] (complex)."""
        table = self._rope_table_for_rows()
        if self.state.batch_size == 1:
            return table[self.first_position - self.table_start]
        return table.index_select(0, self.state.position - self.table_start)

    def _fill_rope_table(self) -> torch.Tensor:
        """Rotations for positions [first, last + ROPE_TABLE_TOKENS): `apply_rope`'s complex
        form of the phases `rope_cos_sin` gives (so bit-identical ones)."""
        start, end = self.first_position, self.last_position + ROPE_TABLE_TOKENS
        positions = torch.arange(start, end, device=self.embed.device).view(1, -1)
        assert self.rope_freqs is not None  # rotations exist under rope only
        cos, sin = rope_cos_sin(positions, self.rope_freqs, self.embed.dtype)  # [1, 1, P, N]
        turn = torch.complex(cos[0, 0, :, ::2], sin[0, 0, :, ::2])  # [P, N/2]
        self.rope_table = turn.unsqueeze(1).contiguous()  # [P, 1, N/2]
        self.table_start = start
        self.graph = None  # it read the old table
        return self.rope_table

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """F.layer_norm's values (the same kernel) without its composite wrapper: a step
        takes 13 norms of a few hundred values, where the wrapper's per-call cost was 3% of
        a batch-1 step on the CPU."""
        return torch.native_layer_norm(
            x, (self.dim,), self.norm_weight, self.norm_bias, self.norm_eps
        )[0]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Read tokens [B] (one per row); return their last-layer hidden states [B, D].

        Token t at offset k of the pending tokens (the state rho0 folded k tokens ago) reads
        d^k q_t.rho0 + sum_(j < k) d^(k - j) (q_t.q_j) v_j, the generic step's
        q_t.rho_t written out (d = 1 without decay); then it joins the pending tokens.
        """
        if self.static:
            return self._fixed_shape_step(tokens)
        h, k, powers = self.heads, self.pending, self.decay_powers
        rotation = self._rope_rotation() if powers is None else None
        u = self._norm(F.embedding(tokens, self.embed))  # [B, D]
        for rho, pending_q, pending_v in self.layers:
            x, q, attn = self._neurons_and_state_read(u, rho, rotation)
            if k:
                scores = pending_scores(q, pending_q[:, :, :k])
                if powers is not None:
                    attn = attn * powers[:, k].view(1, h, 1)
                    reversed_powers = self.decay_powers_reversed
                    assert reversed_powers is not None
                    scores = scores * reversed_powers[:, self.fold_tokens - k : self.fold_tokens]
                attn = torch.baddbmm(attn, scores, pending_v[:, :k])  # values shared by heads
            pending_q[:, :, k].copy_(q)
            pending_v[:, k].copy_(u)
            u = self._layer_output(u, x, attn)
        self.state.position.add_(1)
        self._advance()
        return u

    def _neurons_and_state_read(
        self, u: torch.Tensor, rho: torch.Tensor, rotation: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(neurons x [B, H, N], queries q (x rotated under rope), q.rho [B, H, D]) of one
        layer for inputs u [B, D]; rotation: `apply_rope`'s complex multiply per (2k, 2k+1)
        pair, or None."""
        b, h, n, d = u.shape[0], self.heads, self.neurons, self.dim
        x = torch.mm(u, self.encoder).relu_().view(b, h, n)
        q = x
        if rotation is not None:
            pairs = torch.view_as_complex(x.view(b, h, n // 2, 2))
            q = torch.view_as_real(pairs * rotation).view(b, h, n)
        if self.row_sums is not None:
            rows, offsets = self.row_sums
            attn = F.embedding_bag(
                rows,
                rho.view(b * h * n, d),
                offsets,
                mode="sum",
                per_sample_weights=q.reshape(b * h * n),
            ).view(b, h, d)
        else:
            attn = torch.bmm(q.view(b * h, 1, n), rho.view(b * h, n, d)).view(b, h, d)
        return x, q, attn

    def _layer_output(self, u: torch.Tensor, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's new u [B, D] from its input u, neurons x and attention output attn."""
        b = u.shape[0]
        gate = torch.bmm(self._norm(attn).transpose(0, 1), self.encoder_v).relu_()  # [H, B, N]
        y = (x * gate.transpose(0, 1)).view(b, self.heads * self.neurons)
        return self._norm(u + self._norm(torch.mm(y, self.decoder)))

    def _advance(self) -> None:
        """Count the step on the host; fold the pending tokens once FOLD_TOKENS wait."""
        self.pending += 1
        if self.pending == self.fold_tokens:
            self.flush()
        self.first_position += 1
        self.last_position += 1

    def _fixed_shape_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """`step` at fixed shapes: on CUDA the first call runs eagerly, the second captures
        the step as a CUDA graph, and every later one replays it (captured again after the
        rows or the rope table change)."""
        if self.decay_powers is None:
            self._rope_table_for_rows()
        self.static_tokens.copy_(tokens)
        if not self.embed.is_cuda:
            hidden = self._static_layers()
        else:
            with torch.cuda.device(self.embed.device):  # the model's device, not the current
                hidden = self._graph_step()
        self._advance()
        return hidden

    def _graph_step(self) -> torch.Tensor:
        """The fixed-shape step through its CUDA graph, on the model's device."""
        current = torch.cuda.current_stream()
        capture_stream = self._capture_stream
        assert capture_stream is not None  # set for a static decoder on a CUDA device
        if self.graph is None and not self._graph_warm:
            # One eager step on the capture's own stream before capturing: what a first call
            # sets up (workspaces, the caching allocator's blocks) must not happen in capture.
            capture_stream.wait_stream(current)
            with torch.cuda.stream(capture_stream):
                hidden = self._static_layers()
            current.wait_stream(capture_stream)
            hidden.record_stream(current)
            self._graph_warm = True
            return hidden
        if self.graph is None:
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads' CUDA calls (an NCCL watchdog) do not break capture
            with torch.cuda.graph(
                graph, stream=capture_stream, capture_error_mode="thread_local"
            ):  # records the kernels; runs nothing
                self._graph_hidden = self._static_layers()
            self.graph = graph
        self.graph.replay()
        assert self._graph_hidden is not None  # captured with the graph
        return self._graph_hidden.clone()

    def _static_layers(self) -> torch.Tensor:
        """One step of `static_tokens` [B] through every layer, from device values alone: the
        pending slot is `self.slot`, the rope phase comes from state.position. Advances slot
        and state.position on the device; returns the last layer's hidden states [B, D]."""
        h, rotation = self.heads, None
        if self.decay_powers is None:
            assert self.rope_table is not None
            rotation = self.rope_table.index_select(0, self.state.position - self.table_start)
        slot_weights = self.slot_weights.index_select(0, self.slot)  # [1, H, K]
        slot_decay = self.slot_decay.index_select(0, self.slot).view(1, h, 1)
        u = self._norm(F.embedding(self.static_tokens, self.embed))  # [B, D]
        for rho, pending_q, pending_v in self.layers:
            x, q, attn = self._neurons_and_state_read(u, rho, rotation)
            scores = pending_scores(q, pending_q)
            attn = torch.baddbmm(attn * slot_decay, scores * slot_weights, pending_v)
            pending_q.index_copy_(2, self.slot, q.unsqueeze(2))
            pending_v.index_copy_(1, self.slot, u.unsqueeze(1))
            u = self._layer_output(u, x, attn)
        self.slot.add_(1)
        self.state.position.add_(1)
        return u

    def flush(self) -> None:
        """Fold the pending tokens into rho: state.rho is then the generic step's state."""
        k = self.pending
        if not k:
            return
        b, h, n, d = self.rho.shape[1:]
        for rho, pending_q, pending_v in self.layers:
            keys = pending_q[:, :, :k]  # [B, H, k, N]
            values = pending_v[:, :k].unsqueeze(1).expand(b, h, k, d)
            if self.decay_powers is not None:  # rho_k = d^k rho_0 + sum_j d^(k - j) q_j^T v_j
                assert self.decay_powers_reversed is not None
                rho.mul_(self.decay_powers[:, k].view(1, h, 1, 1))
                weights = self.decay_powers_reversed[:, self.fold_tokens - k : self.fold_tokens]
                keys = keys * weights.view(1, h, k, 1)
            rho.view(b * h, n, d).baddbmm_(
                keys.reshape(b * h, k, n).transpose(1, 2), values.reshape(b * h, k, d)
            )
        self.pending = 0
        self.slot.zero_()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not listed in `rows` (long indices, in the order kept)."""
        self.rho = self.rho.index_select(1, rows)
        self.pending_q = self.pending_q.index_select(1, rows)
        self.pending_v = self.pending_v.index_select(1, rows)
        self._split_layers()
        self.state.position = self.state.position.index_select(0, rows)
        self.static_tokens = self.static_tokens.new_empty(len(rows))  # written every step
        self._positions_known = False
        self.graph = None  # the captured step read the old tensors


Decoder = GenericDecoder | FastDecoder


def make_decoder(
    model: BDH,
    state: ModelState,
    decoder: str = "auto",
    summary_events: SummaryEvents | None = None,
    recent: torch.Tensor | None = None,
) -> Decoder:
    """The decoder `decoder` names ('auto', 'fast' or 'generic') for `state`, read so far."""
    if decoder not in DECODERS:
        raise ValueError(f"unknown decoder {decoder!r}; expected one of {DECODERS}")
    if decoder == "generic" or (decoder == "auto" and fast_decoder_unsupported(model)):
        return GenericDecoder(model, state, summary_events, recent)
    return FastDecoder(model, state)
