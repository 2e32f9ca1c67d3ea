"""A Dragon Hatchling (BDH) language model exported by bdh-train, for Hugging Face
transformers (`AutoModelForCausalLM` with trust_remote_code=True). Needs only torch and
transformers.

u = norm(embed[ids])
repeat n_layer times with THE SAME weights:
    x  = relu(u @ encoder)                 neurons [B, H, T, N], sparse and non-negative
                                           (under config.token_shift relu((u + shift(u)) @
                                           encoder): shift(u) is u at the token before)
    a  = norm(attention(q = x, v = u, rho_l))  linear attention over layer l's carried state
    y  = x * relu(a @ encoder_v)
    u  = norm(u + norm(y @ decoder))
logits = u @ lm_head

The linear attention reads the state before each token writes itself into it:
    out_t = d^r_t q_t.rho0 + sum_{s < t} d^(r_t - r_s) (q_t.q_s) v_s
    rho   = d^R rho0 + sum_s d^(R - r_s) q_s^T v_s
where r_t counts the real (attention_mask = 1) tokens of the call before t and R all of them;
d is alibi's per-head decay (1 under rope). Under rope the queries are rotated by each
token's position, which counts the real tokens a row has read. A padded token (mask 0)
neither writes into the state nor decays it nor advances the position, so a left-padded row
gives its real tokens the logits the row gives unpadded.

Under `config.token_shift` the encoder of every layer application reads u_t + u_p, where p is
the last real token of the row before t (its layer input carried in the cache from the call
before, zeros for a fresh cache): a pad is never a token's previous one. Only the encoder's
input changes; the attention's values and the residual stay u.

Projections named in `config.quant_targets` were trained quantized (BitNet b1.58): the
weights file holds their quantized values, and their inputs are rounded to int8 steps with
one scale per token, as in training.

The whole past of a sequence is `BDHCache`: one rho [B, H, N, D] per layer (and, under the
token shift, the layer's input at the last real token, [B, 1, 1, D]) and each row's position, a
fixed size however long the text. A generated token costs one step on it. A long
input is read `config.prefill_chunk` tokens at a time, the state carrying one block to the next.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_bdh import BDHConfig

# transformers 5 names the output's cache `cache`, earlier versions `past_key_values`
_OUTPUT_CACHE = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


class BDHCache(Cache):
    """BDH's recurrent state: rho [B, H, N, D] for each layer (None before the first token),
    under the token shift `previous` [B, 1, 1, D] for each layer (its input u at the row's
    last real token; None before the first block), each row's position (the real tokens it
    has read) and the columns read so far (what `get_seq_length` reports to `generate`, pads
    included). Its size does not grow with the text; beam search reorders its rows
    (`reorder_cache`)."""

    is_compileable = False

    def __init__(self, n_layer: int) -> None:
        try:
            super().__init__(layers=[])
        except TypeError:  # transformers before 4.54: a Cache takes no layers
            super().__init__()
        self.rho: list[torch.Tensor | None] = [None] * n_layer
        self.previous: list[torch.Tensor | None] = [None] * n_layer
        self.position: torch.Tensor | None = None
        self.columns = 0

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return -1 if self.position is None else int(self.position.shape[0])

    def _map_rows(self, fn) -> None:
        self.rho = [None if r is None else fn(r) for r in self.rho]
        self.previous = [None if p is None else fn(p) for p in self.previous]
        if self.position is not None:
            self.position = fn(self.position)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep row beam_idx[i] as row i (beam search's surviving beams)."""
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices.to(t.device)])

    def reset(self) -> None:
        self.rho = [None] * len(self.rho)
        self.previous = [None] * len(self.previous)
        self.position = None
        self.columns = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a BDH state cannot forget tokens it has read")


def _rotate_pairs(v: torch.Tensor) -> torch.Tensor:
    """rot(v)[2k] = -v[2k+1], rot(v)[2k+1] = v[2k] over the last dimension."""
    return torch.stack((-v[..., 1::2], v[..., ::2]), dim=-1).flatten(-2)


ACT_EPS = 1e-5
"""Guards the int8 activation scale's division."""


def quantize_activation(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 steps, one scale 127 / max|x| per row of the last dimension."""
    xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    scale = 127.0 / xf.abs().amax(dim=-1, keepdim=True).clamp_min(ACT_EPS)
    return ((xf * scale).round().clamp(-128, 127) / scale).to(x.dtype)


def linear_attention(
    q: torch.Tensor,
    v: torch.Tensor,
    rho: torch.Tensor,
    mask: torch.Tensor,
    log_decay: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, T, D], new rho [B, H, N, D]) of queries q [B, H, T, N] (= keys) over
    values v [B, 1, T, D] and the state rho [B, H, N, D], the tokens where `mask` [B, T] is
    False skipped (the module docstring's formula); log_decay [H] (float64) or None."""
    heads = q.shape[1]
    q_write = q * mask.to(q.dtype)[:, None, :, None]
    scores = (q @ q_write.transpose(-1, -2)).tril(-1)  # token t reads s < t: [B, H, T, T]
    counted = mask.long()
    before = counted.cumsum(1) - counted  # r_t, [B, T]
    if log_decay is None:
        out = scores @ v + q @ rho
        return out, rho + q_write.transpose(-1, -2) @ v
    log_d = log_decay.to(q.device).view(1, heads, 1, 1)

    def powers(exponents: torch.Tensor) -> torch.Tensor:  # d^e, taken in float64
        return torch.exp(log_d * exponents.to(torch.float64)).to(q.dtype)

    gap = (before[:, :, None] - before[:, None, :]).clamp_min(0)[:, None]  # [B, 1, T, T]
    total = counted.sum(1)  # R, [B]
    out = (scores * powers(gap)) @ v + (q * powers(before[:, None, :, None])) @ rho
    write = powers((total[:, None] - before)[:, None, :, None])  # d^(R - r_s), [B, H, T, 1]
    new_rho = rho * powers(total.view(-1, 1, 1, 1)) + (q_write * write).transpose(-1, -2) @ v
    return out, new_rho


def previous_real(
    u: torch.Tensor, carried: torch.Tensor | None, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token shift's input and carry: (u at each token's previous real token [B, 1, T, D],
    u at each row's last real token [B, 1, 1, D]) for a block u [B, 1, T, D] whose real tokens
    are where `mask` [B, T] is True. A token's previous real token is the last one before it in
    its row: in this block, else `carried` (the last real token's u of the blocks before
    [B, 1, 1, D]; None: zeros, a fresh cache). A row with no real token keeps `carried`."""
    batch, _, seq_len, dim = u.shape
    if carried is None:
        carried = u.new_zeros(batch, 1, 1, dim)
    read = torch.cat([carried.to(u.dtype), u], dim=2)  # index 0: carried, t + 1: token t
    steps = torch.arange(1, seq_len + 1, device=u.device)
    last = (steps * mask.to(device=u.device, dtype=torch.long)).cummax(dim=1).values  # [B, T]
    before = torch.cat([last.new_zeros(batch, 1), last[:, :-1]], dim=1)  # strictly before t
    shifted = read.gather(2, before[:, None, :, None].expand(batch, 1, seq_len, dim))
    final = last[:, -1:] if seq_len else last.new_zeros(batch, 1)
    kept = read.gather(2, final[:, None, :, None].expand(batch, 1, 1, dim))
    return shifted, kept


class BDHModel(nn.Module):
    """The embedding and the shared layer, with the state they read and write."""

    def __init__(self, config: BDHConfig) -> None:
        super().__init__()
        self.config = config
        h, d, n = config.n_head, config.n_embd, config.n_neurons
        self.embed = nn.Embedding(config.vocab_size, d)
        self.encoder = nn.Parameter(torch.empty(h, d, n))
        self.encoder_v = nn.Parameter(torch.empty(h, d, n))
        self.decoder = nn.Parameter(torch.empty(h * n, d))
        if config.position == "alibi_learned":
            self.decay_log_gain = nn.Parameter(torch.empty(h))
        self.norm = (
            nn.LayerNorm(d, eps=config.norm_eps) if config.norm == "layernorm_affine" else None
        )
        if config.position == "rope":  # the trained model's table, read from the weights
            self.register_buffer("rope_freqs", torch.zeros(n, dtype=torch.float64))

    def _apply(self, fn, recurse=True):
        """Casts of the model (`.to(dtype)`, `.half()`) move the rope frequencies to the new
        device but keep them in float64: the phases are taken in float64."""
        frequencies = getattr(self, "rope_freqs", None)
        super()._apply(fn, recurse)
        if frequencies is not None and frequencies.dtype == torch.float64:
            self.rope_freqs = frequencies.to(self.rope_freqs.device)
        return self

    def _project(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight, x rounded to int8 first where the projection was trained quantized."""
        if name in self.config.quant_targets:
            x = quantize_activation(x)
        return x @ weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            return self.norm(x)
        return F.layer_norm(x, (x.shape[-1],), eps=self.config.norm_eps)

    def _log_decay(self) -> torch.Tensor | None:
        """Each head's log d [H] in float64: -2^(-h/H) (alibi_spread: -2^(-8(h+1)/H);
        alibi_slow: the last head's -1/16), times exp(gain) when learned."""
        position = self.config.position
        if position == "rope":
            return None
        h = torch.arange(self.config.n_head, dtype=torch.float64, device=self.encoder.device)
        if position == "alibi_spread":
            return -(2.0 ** (-8.0 * (h + 1) / self.config.n_head))
        log_decay = -(2.0 ** (-h / self.config.n_head))
        if position == "alibi_slow":
            log_decay[-1] = -1.0 / 16
        if position == "alibi_learned":
            log_decay = log_decay * torch.exp(self.decay_log_gain.to(torch.float64))
        return log_decay

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin [B, 1, T, N] of the phases of positions [B, T], taken in float64."""
        turns = positions.to(torch.float64).unsqueeze(-1) * self.rope_freqs
        phase = torch.frac(turns) * (2 * math.pi)
        return phase.cos().to(dtype).unsqueeze(1), phase.sin().to(dtype).unsqueeze(1)

    def forward_block(self, ids: torch.Tensor, mask: torch.Tensor, cache: BDHCache) -> torch.Tensor:
        """Hidden states [B, T, D] of one block of tokens; advances `cache`."""
        batch, seq_len = ids.shape
        c = self.config
        if cache.position is None:
            cache.position = torch.zeros(batch, dtype=torch.long, device=ids.device)
        counted = mask.long()
        positions = cache.position[:, None] + counted.cumsum(1) - counted
        u = self._norm(self.embed(ids)).unsqueeze(1)  # [B, 1, T, D]
        rope = self._rope(positions, u.dtype) if c.position == "rope" else None
        log_decay = self._log_decay()
        for layer in range(c.n_layer):
            rho = cache.rho[layer]
            if rho is None:
                rho = u.new_zeros(batch, c.n_head, c.n_neurons, c.n_embd)
            read = u
            if c.token_shift:
                shifted, cache.previous[layer] = previous_real(u, cache.previous[layer], mask)
                read = u + shifted
            x = F.relu(self._project("encoder", read, self.encoder))  # [B, H, T, N]
            q = x if rope is None else x * rope[0] + _rotate_pairs(x) * rope[1]
            a, cache.rho[layer] = linear_attention(q, u, rho, mask, log_decay)
            y = x * F.relu(self._project("encoder_v", self._norm(a), self.encoder_v))
            rows = y.transpose(1, 2).reshape(batch, seq_len, -1)  # every head's neurons
            m = self._project("decoder", rows, self.decoder)
            u = self._norm(u + self._norm(m).unsqueeze(1))
        cache.position = cache.position + counted.sum(1)
        cache.columns += seq_len
        return u.squeeze(1)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, cache: BDHCache) -> torch.Tensor:
        """Hidden states [B, T, D], read `config.prefill_chunk` tokens at a time."""
        size = self.config.prefill_chunk
        blocks = [
            self.forward_block(ids[:, i : i + size], mask[:, i : i + size], cache)
            for i in range(0, ids.shape[1], size)
        ]
        if not blocks:
            return ids.new_zeros(ids.shape[0], 0, self.config.n_embd, dtype=self.encoder.dtype)
        return torch.cat(blocks, dim=1)


class BDHPreTrainedModel(PreTrainedModel):
    """Weight initialisation and loading for BDH models."""

    config_class = BDHConfig
    base_model_prefix = "model"
    _no_split_modules: list[str] = []
    _is_stateful = True

    def _init_weights(self, module: nn.Module) -> None:
        """Official init: every weight N(0, 0.02), the affine norm as identity, learned decay
        gains 0 (alibi's decay). The rope frequencies come only from the weights file."""
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, BDHModel):
            for p in (module.encoder, module.encoder_v, module.decoder):
                nn.init.normal_(p, std=0.02)
            if hasattr(module, "decay_log_gain"):
                nn.init.zeros_(module.decay_log_gain)
        elif isinstance(module, BDHForCausalLM):
            nn.init.normal_(module.lm_head, std=0.02)


class BDHForCausalLM(BDHPreTrainedModel, GenerationMixin):
    """BDH with its token head: logits, the loss of `labels`, and `generate()` (greedy,
    sampling, beam search) on the recurrent `BDHCache`."""

    def __init__(self, config: BDHConfig) -> None:
        super().__init__(config)
        self.model = BDHModel(config)
        self.lm_head = nn.Parameter(torch.empty(config.n_embd, config.vocab_size))
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own BDHCache

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> None:
        return None  # lm_head is a [D, V] matrix of its own, tied to nothing

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        cache: BDHCache | None = None,
        past_key_values: BDHCache | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = True,
        **kwargs,
    ) -> dict:
        """The columns the cache has not read yet (every column without a cache)."""
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache is not False:
            cache = BDHCache(self.config.n_layer)
        read = 0 if cache is None else cache.get_seq_length()
        inputs = {
            "input_ids": input_ids[:, read:],
            "attention_mask": attention_mask,
            "cache": cache,
            "use_cache": use_cache,
        }
        if kwargs.get("logits_to_keep") is not None:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: BDHCache | None = None,
        past_key_values: BDHCache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ):
        """Logits [B, T, V] of input_ids [B, T] continuing `cache` (a new one when None and
        use_cache is not False), whose last T columns of `attention_mask` mark the real
        tokens (pads are 0); `labels` [B, T] (-100: not counted) give the mean cross-entropy
        of predicting labels[:, 1:] from the tokens before."""
        if inputs_embeds is not None:
            raise ValueError("BDH reads token ids only: pass input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("BDH needs input_ids")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, BDHCache):
            raise TypeError(f"BDH carries its state in a BDHCache, got {type(cache).__name__}")
        if cache is None:
            cache = BDHCache(self.config.n_layer)
        seq_len = input_ids.shape[1]
        if attention_mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            mask = attention_mask[:, attention_mask.shape[1] - seq_len :].to(torch.bool)
        hidden = self.model(input_ids, mask.to(input_ids.device), cache)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        logits = kept @ self.lm_head
        loss = None
        if labels is not None:
            targets = labels[:, 1:].to(logits.device)
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                targets.reshape(-1),
                ignore_index=-100,
            )
        outputs = {"loss": loss, "logits": logits}
        if use_cache is not False:
            outputs[_OUTPUT_CACHE] = cache
        return CausalLMOutputWithPast(**outputs)
