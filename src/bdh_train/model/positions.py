"""Position schemes.

rope rotates the queries (= keys) by absolute position, so the carried state must remember
where each row is; alibi decays the state per head and per token, which needs no position;
alibi_learned is alibi with each head's decay rate learned; alibi_spread decays it at ALiBi's
own rates, spread from a few tokens' memory to hundreds; alibi_slow keeps alibi's rates on
every head but the last, which remembers SLOW_HEAD_TOKENS tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

ROPE_THETA = 2.0**16


def rope_frequencies(n: int, device: torch.device | None = None) -> torch.Tensor:
    """freq[i] = 1 / theta^(2*floor(i/2) / n) / (2*pi), in float64 (shape [n])."""
    i = torch.arange(n, dtype=torch.float64, device=device)
    return 1.0 / ROPE_THETA ** (torch.floor(i / 2) * 2 / n) / (2 * math.pi)


def rope_phase(positions: torch.Tensor, freqs: torch.Tensor | int) -> torch.Tensor:
    """phase = frac(p * freq) * 2 pi in float64 for absolute positions [B, T] and a per-neuron
    frequency table [N] (a model's `rope_freqs`; an int N: `rope_frequencies(N)`) -> [B, T, N].

    Computed in float64 from integer positions, so a token gets bit-identical phases however
    the sequence is split into calls, and a neuron's phases depend on its own frequency only.
    """
    if isinstance(freqs, int):
        freqs = rope_frequencies(freqs, positions.device)
    freqs = freqs.to(device=positions.device, dtype=torch.float64)
    turns = positions.to(torch.float64).unsqueeze(-1) * freqs
    return torch.frac(turns) * (2 * math.pi)


def rope_cos_sin(
    positions: torch.Tensor, freqs: torch.Tensor | int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of `rope_phase` for absolute positions [B, T] -> each [B, 1, T, N]."""
    phase = rope_phase(positions, freqs)
    return phase.cos().to(dtype).unsqueeze(1), phase.sin().to(dtype).unsqueeze(1)


class RopePhases(NamedTuple):
    """rope's terms for one forward, each [B, 1, T, .]: cos and sin of the phases and, where
    `apply_rope` multiplies complex pairs, the unit turns cos + i sin per (2k, 2k+1) pair
    and their conjugates (backward's), built once for all layers (None elsewhere)."""

    cos: torch.Tensor
    sin: torch.Tensor
    turn: torch.Tensor | None
    back: torch.Tensor | None


def _turns_apply(n: int, dtype: torch.dtype) -> bool:
    """Whether rope rotates pairs by a complex multiply: an even N in float32/64."""
    return n % 2 == 0 and dtype in (torch.float32, torch.float64)


def _unit_turns(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos + i sin, cos - i sin) per (2k, 2k+1) pair, whose members share a phase."""
    turn = torch.complex(cos[..., ::2], sin[..., ::2])
    return turn, turn.conj().resolve_conj()


def rope_phases(
    positions: torch.Tensor, freqs: torch.Tensor | int, dtype: torch.dtype
) -> RopePhases:
    """`RopePhases` for absolute positions [B, T] (`rope_cos_sin`'s phases)."""
    cos, sin = rope_cos_sin(positions, freqs, dtype)
    n = cos.shape[-1]
    if not _turns_apply(n, dtype):
        return RopePhases(cos, sin, None, None)
    return RopePhases(cos, sin, *_unit_turns(cos, sin))


def rotate_pairs(v: torch.Tensor) -> torch.Tensor:
    """rot(v)[2k] = -v[2k+1], rot(v)[2k+1] = v[2k] over the last dimension."""
    return torch.stack((-v[..., 1::2], v[..., ::2]), dim=-1).flatten(-2)


def _as_pairs(v: torch.Tensor) -> torch.Tensor:
    """v [..., N] as N/2 complex numbers (2k, 2k+1): a view when every pair lies side by side
    at an even offset (any order of the other dims), else of a contiguous copy."""
    pairs_side_by_side = (
        v.stride(-1) == 1
        and v.storage_offset() % 2 == 0
        and all(stride % 2 == 0 for stride in v.stride()[:-1])
    )
    if not pairs_side_by_side:  # a broadcast gradient (stride 0), a strided slice
        v = v.clone(memory_format=torch.contiguous_format)
    return torch.view_as_complex(v.reshape(*v.shape[:-1], v.shape[-1] // 2, 2))


class _TurnPairs(torch.autograd.Function):
    """v's pairs times the unit complex numbers `turn` (which take no gradient). Backward
    turns the gradient back (times conj(turn)) in the layout it arrives in; autograd's own
    backward of view_as_real would first copy it into a contiguous tensor."""

    @staticmethod
    def forward(ctx, v: torch.Tensor, turn: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back)
        return torch.view_as_real(_as_pairs(v) * turn).reshape(v.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        return torch.view_as_real(_as_pairs(grad) * back).reshape(grad.shape), None, None


def apply_rope(
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    turn: torch.Tensor | None = None,
    back: torch.Tensor | None = None,
) -> torch.Tensor:
    """v*cos + rot(v)*sin. For float32/64 with an even N this is one complex multiply per
    (2k, 2k+1) pair (both members share a frequency), instead of five elementwise passes;
    `turn`, `back`: those pairs' cos + i sin and its conjugate when the caller built them
    (`rope_phases`)."""
    fast = _turns_apply(v.shape[-1], v.dtype) and cos.dtype == v.dtype
    if fast and not torch.compiler.is_compiling():  # inductor does not generate complex code
        if turn is None or back is None:
            turn, back = _unit_turns(cos, sin)
        if cos.requires_grad or sin.requires_grad:
            return torch.view_as_real(_as_pairs(v) * turn).reshape(v.shape)
        return _TurnPairs.apply(v, turn, back)
    return v * cos + rotate_pairs(v) * sin


def decay_powers(
    log_decay: torch.Tensor, exponents: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """d_h^e for every e in `exponents` -> [H, *exponents.shape] in `like`'s dtype and device,
    taken in float64 and rounded once. Powers below sqrt(tiny) of that dtype (float32's for a
    narrower one: 1e-19) are 0: they weigh a term by less than that against the newest
    token's, and products of them run into denormal numbers, which the CPU computes several
    times slower (measured 2-5x on the whole mixer)."""
    log_decay = log_decay.to(like.device).view(-1, *([1] * exponents.dim()))
    powers = torch.exp(log_decay * exponents.to(device=like.device, dtype=torch.float64))
    return torch.where(powers >= negligible_power(like.dtype), powers, 0.0).to(like.dtype)


def negligible_power(dtype: torch.dtype) -> float:
    """The smallest decay power `decay_powers` keeps for a tensor of `dtype`: sqrt(tiny) of
    it (float32's for a narrower one)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).tiny ** 0.5


def decay_horizons(log_decay: torch.Tensor, dtype: torch.dtype) -> list[int | None]:
    """Each head's exponent W_h from which `decay_powers` gives 0 for that head of
    `log_decay` [H] (a tensor of `dtype`): a token W_h or more positions back weighs nothing
    in head h, and neither does an incoming state W_h or more tokens into a call. None for a
    head that does not decay. Past floor(ln(1 / negligible) / r) + 1 a head's rate r falls
    below the threshold; one more exponent keeps the float64 rounding of the powers off that
    edge."""
    reach = math.log(1.0 / negligible_power(dtype))
    return [math.floor(reach / -r) + 2 if r < 0 else None for r in log_decay.tolist()]


def alibi_log_decay(n_head: int) -> torch.Tensor:
    """log d_h = -slope_h with slope_h = 2^(-h/H): the per-head, per-token state decay."""
    h = torch.arange(n_head, dtype=torch.float64)
    return -(2.0 ** (-h / n_head))


def alibi_spread_log_decay(n_head: int) -> torch.Tensor:
    """log d_h = -slope_h with ALiBi's geometric slopes slope_h = 2^(-8(h+1)/H) (Press et al.):
    for H = 4, 1/4, 1/16, 1/64 and 1/256, so a token's weight in the state falls to 1/e after
    4, 16, 64 and 256 tokens, where alibi's slopes (0.59-1) forget it within two."""
    h = torch.arange(n_head, dtype=torch.float64)
    return -(2.0 ** (-8.0 * (h + 1) / n_head))


SLOW_HEAD_TOKENS = 16
"""alibi_slow's last head: its rate is 1 / SLOW_HEAD_TOKENS, so a token's weight in its
state falls to 1/e after this many tokens (alibi's heads forget it within two)."""


def alibi_slow_log_decay(n_head: int) -> torch.Tensor:
    """alibi's log-decays -2^(-h/H) for heads 0..H-2, and -1/SLOW_HEAD_TOKENS for the last:
    for H = 4, memories of 1, 1.2, 1.4 and 16 tokens."""
    log_decay = alibi_log_decay(n_head)
    log_decay[-1] = -1.0 / SLOW_HEAD_TOKENS
    return log_decay


def learned_alibi_log_decay(log_gain: torch.Tensor) -> torch.Tensor:
    """log d_h = -slope_h * exp(log_gain_h) in float64, for the per-head gains [H].

    The gain multiplies alibi's decay rate, so the log-decay stays negative for every gain
    (d_h in (0, 1)), a step moves each head's rate by a relative amount, and gains of zero
    give alibi_log_decay exactly (exp(0) = 1), whatever dtype the gains are stored in.
    """
    slopes = alibi_log_decay(log_gain.shape[0]).to(log_gain.device)
    return slopes * torch.exp(log_gain.to(torch.float64))


def position_log_decay(
    position: str, n_head: int, log_gain: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Each head's log-decay [H] in float64 for a model of `position` (None: rope, no decay);
    `log_gain`: alibi_learned's per-head gains."""
    if position == "rope":
        return None
    if position == "alibi_learned":
        if log_gain is None:
            raise ValueError("alibi_learned needs the per-head gains (decay_log_gain)")
        return learned_alibi_log_decay(log_gain)
    if position == "alibi_spread":
        return alibi_spread_log_decay(n_head)
    if position == "alibi_slow":
        return alibi_slow_log_decay(n_head)
    return alibi_log_decay(n_head)
