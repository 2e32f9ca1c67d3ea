"""The BDH module: read it top to bottom.

u = norm(embed[idx])
repeat n_layer times with THE SAME weights:
    (u = u + summary memory of past chunks, in the layers that have one: summary.py)
    x  = relu((u + shift(u)) @ encoder)    neurons, sparse and non-negative (the shift,
                                           u at the token before, only under token_shift)
    a  = norm(mixer(q = x, v = u, rho_l))  linear attention over the carried state
    y  = dropout(x * relu(a @ encoder_v))
    u  = norm(u + norm(y @ decoder))
logits = u @ lm_head                   (or the NCA factorized head's loss)

Quantization-aware training hooks in at `_project`; the head loss lives in heads.py.

Recomputation (`set_recompute`, one of RECOMPUTE_MODES) trades one extra forward for the
activations backward would otherwise keep: 'layer' keeps only each layer's inputs (u, rho)
and re-runs the whole layer in backward; 'mixer' re-runs only the linear attention (`mix`).
It is active only while gradients are recorded in training mode.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from bdh_train.errors import BDHTrainError
from bdh_train.model.config import BDHConfig, head_parameter_shapes
from bdh_train.model.gate import GateKernels, gate
from bdh_train.model.heads import nca_factorized_loss, token_cross_entropy
from bdh_train.model.matmul import heads_matmul, is_heads_major, per_head_matmul
from bdh_train.model.mixer import linear_attention
from bdh_train.model.positions import (
    apply_rope,
    position_log_decay,
    rope_frequencies,
    rope_phases,
)
from bdh_train.model.quant import LowBitQuantizer
from bdh_train.model.state import ModelState
from bdh_train.model.summary import summary_branch

LN_EPS = 1e-5

ROPE_FREQS = "rope_freqs"
"""The buffer (and state_dict key) of a rope model's per-neuron frequency table [N], float64."""
DEFAULTED_KEYS = frozenset({ROPE_FREQS})
"""state_dict keys a checkpoint may lack: written before they existed, they load as the values
every such checkpoint had (`rope_frequencies(N)`)."""


def state_shapes(config: BDHConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of `BDH(config).state_dict()`, from the sizes alone (nothing
    is allocated): what a checkpoint of this config holds, to check a file's tensors against
    its config before building the model."""
    c = config
    h, d, n = c.n_head, c.n_embd, c.n_neurons
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (c.vocab_size, d),
        "encoder": (h, d, n),
        "encoder_v": (h, d, n),
        "decoder": (h * n, d),
    }
    if c.position == "alibi_learned":
        shapes["decay_log_gain"] = (h,)
    shapes.update(head_parameter_shapes(c))
    if c.norm == "layernorm_affine":
        shapes["norm.weight"] = shapes["norm.bias"] = (d,)
    if c.position == "rope":
        shapes[ROPE_FREQS] = (n,)
    return shapes


def shape_mismatch(
    own: Mapping[str, tuple[int, ...]], weights: Mapping[str, tuple[int, ...]]
) -> str | None:
    """Where a file's tensors `weights` (name -> shape) do not fit the model's `own`: every
    key missing from the file (one of DEFAULTED_KEYS may be: the model fills it), every
    unexpected key and every shape that differs, as one clause for the caller's message;
    None when they fit. On shapes alone, so it runs before a model is built (`state_shapes`)."""
    missing = sorted(set(own) - set(weights) - DEFAULTED_KEYS)
    unexpected = sorted(set(weights) - set(own))
    wrong = [
        f"{k}: checkpoint {list(weights[k])} vs model {list(own[k])}"
        for k in sorted(set(own) & set(weights))
        if tuple(weights[k]) != tuple(own[k])
    ]
    parts = []
    if missing:
        parts.append(f"missing keys {missing}")
    if unexpected:
        parts.append(f"unexpected keys {unexpected}")
    if wrong:
        parts.append("mismatched shapes: " + "; ".join(wrong))
    return ", ".join(parts) if parts else None


RECOMPUTE_MODES = ("none", "layer", "mixer")
"""What backward recomputes instead of keeping: nothing, the whole shared layer, or its mixer."""

COMPILE_MODES = ("off", "layer", "pointwise", "auto")
"""What training compiles (`BDH.compile_for_training`): nothing, the whole shared layer, the
gate's fused kernels, or the one that measured faster on the device (the layer on CUDA: 1.24x
eager on an H200; the gate on a CPU, where the compiled layer ran 0.91-0.99x eager and the
fused gate 1.03-1.08x)."""


def compile_mode_for(mode: str, device: torch.device) -> str:
    """A COMPILE_MODES mode with 'auto' resolved for `device`: 'layer' on CUDA, else
    'pointwise'."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; expected one of {COMPILE_MODES}")
    if mode != "auto":
        return mode
    return "layer" if device.type == "cuda" else "pointwise"


def check_compiler(mode: str, device: torch.device) -> None:
    """Refuse a CPU compile where inductor finds no C++ compiler to build its kernels with,
    before the run starts, instead of failing inside its first step."""
    if device.type != "cpu" or compile_mode_for(mode, device) == "off":
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another torch: inductor looks for its compiler itself
        return
    try:
        get_cpp_compiler()
    except Exception as e:  # inductor's InvalidCxxCompiler, or the search failing otherwise
        lines = str(e).strip().splitlines()
        reason = lines[0] if lines else type(e).__name__
        raise BDHTrainError(
            f"training.compile = {mode!r} builds C++ kernels on the CPU, but torch's inductor "
            f"found no C++ compiler ({reason}); install g++ (or point CXX at a compiler), or "
            "set training.compile = false"
        ) from e


def physical_memory() -> int | None:
    """This machine's memory in bytes; None where the platform does not report it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def parameter_bytes(config: BDHConfig) -> int:
    """The bytes of the parameters of `config`'s model in the default dtype (nothing is
    allocated)."""
    return config.parameter_count() * (torch.finfo(torch.get_default_dtype()).bits // 8)


def _check_fits_in_memory(config: BDHConfig) -> None:
    """Refuse, before allocating, a model whose parameters alone exceed this machine's memory."""
    memory = physical_memory()
    if memory is None:
        return
    if parameter_bytes(config) > memory:
        raise config.size_error(f"this machine's memory holds ({memory / 2**30:.0f} GiB)")


class ActivationRecorder(Protocol):
    """What `BDH.recorder` is: told the layer, then handed its x and pre
    (`model/activity.py` records them)."""

    layer: int

    def record(self, x: torch.Tensor, pre: torch.Tensor) -> None: ...


class BDH(nn.Module):
    """A Dragon Hatchling (BDH) language model: token embedding, one set of layer weights
    applied n_layer times, and the language head `config.language_head` names (the layer
    loop is written out in this module's docstring).

    `forward_hidden` gives the last layer's hidden states and, given a `ModelState`,
    continues from it and advances it; `loss_from_hidden` and `logits_from_hidden` apply the
    head; `forward` is (logits, mean loss). Generation takes the model
    (`model/sampling.py`: `generate(model, ...)`); the model knows nothing of it.
    """

    norm_eps: float = LN_EPS
    """eps of every layer norm."""

    # The head's parameters, registered by __init__ by name (`head_parameter_shapes`): the
    # token head has lm_head, the NCA head nca_lm_head (and maybe nca_special_head).
    lm_head: nn.Parameter
    nca_lm_head: nn.Parameter
    rope_freqs: torch.Tensor
    """Under rope: each neuron's rotation frequency [N] in float64, the same for every head
    (a fresh model's: `rope_frequencies(N)`; a merged or grown model keeps its sources'). Saved
    with the weights; it stays float64 whatever dtype the model is cast to."""

    def __init__(self, config: BDHConfig):
        super().__init__()
        self.config = config.validate()
        c = config
        _check_fits_in_memory(c)
        h, d, n = c.n_head, c.n_embd, c.n_neurons
        self.embed = nn.Embedding(c.vocab_size, d)
        self.encoder = nn.Parameter(torch.empty(h, d, n))
        self.encoder_v = nn.Parameter(torch.empty(h, d, n))
        self.decoder = nn.Parameter(torch.empty(h * n, d))
        if c.position == "alibi_learned":  # log d_h = -slope_h * exp(decay_log_gain_h)
            self.decay_log_gain = nn.Parameter(torch.empty(h))
        # lm_head [D, V] for the token head; nca_lm_head (+ nca_special_head) for the NCA head
        for name, shape in head_parameter_shapes(c).items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))
        self.norm = nn.LayerNorm(d, eps=LN_EPS) if c.norm == "layernorm_affine" else None
        self.quantizer = LowBitQuantizer(c.quant) if c.quant.enable else None
        self.recompute = "none"
        # the training twin of layer_call, from compile_layers()
        self._compiled_layer: Callable[..., Any] | None = None
        self._gate_kernels: GateKernels | None = None  # from use_fused_gate()
        self.recorder: ActivationRecorder | None = None  # model/activity.py's `recording`
        self._summary_layers = frozenset(c.summary_memory.layers(c.n_layer))
        if c.position == "rope":
            self.register_buffer(ROPE_FREQS, rope_frequencies(n))
            self.register_load_state_dict_pre_hook(_default_rope_freqs)
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        """Module._apply (to, cuda, half, ...) that moves the rope table but keeps it float64:
        a phase in float32 would drift by whole turns at long positions."""
        table = self._buffers.get(ROPE_FREQS)
        super()._apply(fn, recurse)
        moved = self._buffers.get(ROPE_FREQS)
        if table is not None and moved is not None and moved.dtype != torch.float64:
            self._buffers[ROPE_FREQS] = table.to(moved.device)
        return self

    def reset_parameters(self) -> None:
        """Official init: every weight N(0, 0.02); the shared affine norm starts as identity."""
        heads = [getattr(self, name) for name in head_parameter_shapes(self.config)]
        for p in (self.embed.weight, self.encoder, self.encoder_v, self.decoder, *heads):
            nn.init.normal_(p, std=0.02)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.config.position == "alibi_learned":
            nn.init.zeros_(self.decay_log_gain)  # alibi's decay, exactly

    # ---------------------------------------------------------------- building blocks
    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if is_heads_major(x):  # normalized row by row: keep the layout (no copy)
            return self._norm(x.transpose(0, 1)).transpose(0, 1)
        if self.norm is not None:
            return self.norm(x)
        return F.layer_norm(x, (x.shape[-1],), eps=LN_EPS)

    def _project(self, name: str, inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """inputs @ weight for the three shared projections; the quantization hook.

        `name` is the parameter's name ('encoder', 'encoder_v', 'decoder'); the quantizer maps
        it to the paper's target names and quantizes only the targeted projections.
        """
        if self.quantizer is not None and self.quantizer.applies_to(name):
            return self.quantizer.project(name, inputs, weight)
        return per_head_matmul(inputs, weight)

    def _decode(self, y: torch.Tensor) -> torch.Tensor:
        """The decoder projection of y [B, H, T, N] (every head's neurons side by side) ->
        [B, 1, T, D]; a targeted quantizer takes the side-by-side rows [B, 1, T, H*N]."""
        if self.quantizer is not None and self.quantizer.applies_to("decoder"):
            batch, heads, seq_len, n = y.shape
            rows = y.transpose(1, 2).reshape(batch, 1, seq_len, heads * n)
            return self.quantizer.project("decoder", rows, self.decoder)
        return heads_matmul(y, self.decoder)

    def set_quant_step(self, step: int) -> None:
        """Training step for the quantization warm-up: lambda = min(1, step / warmup_steps).

        Call it every step (and after resuming); a no-op for a float model.
        """
        if self.quantizer is not None:
            self.quantizer.set_step(step)

    def set_recompute(self, mode: str) -> None:
        """Choose what backward recomputes (one of RECOMPUTE_MODES); 'none' keeps everything.

        'layer': every layer call keeps only its inputs u [B, 1, T, D] and rho [B, H, N, D]
        and runs the layer again in backward (about one more forward per step); 'mixer': only
        `mix` runs again, so the T x T (or chunk) score matrices, the rotated queries and the
        attention output are not kept. Either way the gradients are those of 'none': the
        recomputation restores the random generators' state (dropout draws the same mask)
        and every other input of the layer is deterministic. Active only when gradients are
        recorded in training mode, so evaluation and generation pay nothing.
        """
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"unknown recompute mode {mode!r}; expected one of {RECOMPUTE_MODES}")
        self.recompute = mode

    def _recomputing(self, mode: str) -> bool:
        """Whether `mode` is set and this forward records gradients in training mode."""
        return self.recompute == mode and self.training and torch.is_grad_enabled()

    def init_state(self, batch_size: int) -> ModelState:
        return ModelState(self.config.n_layer, batch_size, self.embed.weight.device)

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> normalized embeddings [B, T, D] (the first layer's input)."""
        return self._norm(self.embed(idx))

    def _position_terms(self, positions: torch.Tensor, dtype: torch.dtype):
        """What the mixer needs for positions [B, T]: rope cos/sin or alibi log-decays."""
        if self.config.position == "rope":
            return rope_phases(positions, self.rope_freqs, dtype), None
        return None, self.log_decay()

    def log_decay(self) -> torch.Tensor | None:
        """Each head's log-decay of the state [H] in float64 (None under rope: no decay)."""
        gain = self.decay_log_gain if self.config.position == "alibi_learned" else None
        return position_log_decay(self.config.position, self.config.n_head, gain)

    def layer(
        self,
        u: torch.Tensor,
        layer_index: int,
        state: ModelState,
        position_terms,
        executor: str | None = None,
        need_state: bool = True,
        summary_event_mask: torch.Tensor | None = None,
        reset_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One application of the shared layer to u [B, 1, T, D]; updates state.rho[layer]
        (and the layer's summary memory, where it has one). `reset_mask` [B, T] marks where
        a row's new document begins (the mixer drops the state before it)."""
        if layer_index in self._summary_layers:
            u, carry = summary_branch(
                u,
                state.summary[layer_index],
                state.position,
                self.config.summary_memory,
                summary_event_mask,
            )
            if need_state:
                state.summary[layer_index] = carry
        if self.recorder is not None:
            self.recorder.layer = layer_index
        shifted = None
        if self.config.token_shift:
            shifted = previous_tokens(u, state.previous[layer_index], reset_mask)
            if need_state and u.shape[2]:
                state.previous[layer_index] = u[:, :, -1:].clone()
        layer_fn, rho = self._layer_fn_for(u, state.rho[layer_index], need_state, reset_mask)
        u, new_rho = layer_fn(
            u,
            rho,
            position_terms,
            executor or self.config.executor,
            need_state,
            reset_mask,
            shifted,
        )
        if need_state:
            state.rho[layer_index] = new_rho
        return u

    def layer_call(
        self,
        u: torch.Tensor,
        rho: torch.Tensor | None,
        position_terms,
        executor: str,
        need_state: bool,
        reset_mask: torch.Tensor | None = None,
        shifted: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`layer_step`, under activation checkpointing when recompute is 'layer'."""
        args = (u, rho, position_terms, executor, need_state, reset_mask, shifted)
        if self._recomputing("layer"):
            return checkpoint(self.layer_step, *args, use_reentrant=False, preserve_rng_state=True)
        return self.layer_step(*args)

    def layer_step(
        self,
        u: torch.Tensor,
        rho: torch.Tensor | None,
        position_terms,
        executor: str,
        need_state: bool,
        reset_mask: torch.Tensor | None = None,
        shifted: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer as a pure function (u, rho) -> (new u, new rho), for compile_layers.
        `shifted` [B, 1, T, D]: the token shift's u at each token's previous token
        (`previous_tokens`), added to u where the encoder reads it; None without the shift."""
        read = u if shifted is None else u + shifted
        x = F.relu(self._project("encoder", read, self.encoder))  # [B, H, T, N]
        mix_args = (x, u, rho, position_terms, executor, need_state, reset_mask)
        if self._recomputing("mixer"):
            a, new_rho = checkpoint(
                self.mix, *mix_args, use_reentrant=False, preserve_rng_state=True
            )
        else:
            a, new_rho = self.mix(*mix_args)
        pre = self._project("encoder_v", a, self.encoder_v)
        if self.recorder is not None:
            self.recorder.record(x, pre)
        y = gate(x, pre, self._gate_kernels)
        y = F.dropout(y, self.config.dropout, self.training)
        m = self._norm(self._decode(y))
        return self._norm(u + m), new_rho

    def mix(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        rho: torch.Tensor | None,
        position_terms,
        executor: str,
        need_state: bool,
        reset_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's mixer: neurons x [B, H, T, N] (rotated into queries under rope) read
        and write the state over values u [B, 1, T, D]; -> (norm of the attention output
        [B, H, T, D], new rho). Recompute 'mixer' re-runs exactly this in backward (rope, the
        executor's score matrices and the norm; no projection and no random draw), keeping
        only its inputs: x, u, rho and the position terms (the projections keep x and u
        anyway)."""
        rope, log_decay = position_terms
        q = x if rope is None else apply_rope(x, *rope)
        attn, new_rho = linear_attention(
            q,
            u,
            executor=executor,
            initial_state=rho,
            log_decay=log_decay,
            chunk_size=self.config.chunk_size,
            output_final_state=need_state,
            reset_mask=reset_mask,
        )
        return self._norm(attn), new_rho

    def compile_layers(self, **options) -> None:
        """torch.compile the layer for training: one graph, shared by every layer (the weights
        are shared) and every step, recomputation included, built on the first call with
        gradients.

        The graph is specialised to that call: its batch and length, whether it computes a
        final state and whether it applies resets inside the call; the state is always a
        tensor (zeros stand in for a fresh one), so the first chunk and the later ones of a
        TBPTT block match. Calls that differ (a shorter TBPTT tail, a block with a reset
        mid-call) and calls without gradients (evaluation, generation) run the eager layer,
        so nothing is ever compiled twice."""
        self._compiled_layer = torch.compile(self.layer_call, dynamic=False, **options)
        self._compiled_signature: tuple[tuple[int, ...], bool, bool] | None = None

    def use_fused_gate(self, kernels: GateKernels | None) -> None:
        """Run the layer's gate x * relu(a @ encoder_v) through `kernels` (one fused pass each
        way, bit-identical values and gradients); None: autograd's composition again."""
        self._gate_kernels = kernels

    def compile_for_training(self, mode: str) -> None:
        """Apply a COMPILE_MODES mode ('auto' resolved by `compile_mode_for` for the device the
        parameters are on): 'layer' compiles the whole layer (`compile_layers`), 'pointwise'
        the gate's kernels (`use_fused_gate`), 'off' nothing."""
        mode = compile_mode_for(mode, self.encoder.device)
        if mode == "layer":
            self.compile_layers()
        elif mode == "pointwise":
            self.use_fused_gate(GateKernels(compiled=True))

    def _layer_fn_for(self, u: torch.Tensor, rho, need_state: bool, reset_mask) -> tuple:
        """(layer function, state) for one call: the compiled layer where its graph fits."""
        if self._compiled_layer is None or not torch.is_grad_enabled():
            return self.layer_call, rho
        signature = (tuple(u.shape), need_state, reset_mask is None)
        if self._compiled_signature is None:
            self._compiled_signature = signature
        if signature != self._compiled_signature:
            return self.layer_call, rho
        if rho is None:
            c = self.config
            rho = u.new_zeros(u.shape[0], c.n_head, c.n_neurons, c.n_embd)
        return self._compiled_layer, rho

    # ---------------------------------------------------------------- entry points
    def forward_hidden(
        self,
        idx: torch.Tensor,
        state: ModelState | None = None,
        executor: str | None = None,
        layers: range | None = None,
        u: torch.Tensor | None = None,
        summary_event_mask: torch.Tensor | None = None,
        reset_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, T, D]. With a state, continue from it and advance it in place.

        `layers` and `u` let a pipeline stage run a contiguous range of layers on the
        previous stage's output; the position advances only after the last layer.
        `summary_event_mask` [B, T] marks summary events for the summary memory's write gate;
        it has no effect without one. `reset_mask` [B, T] (bool) marks where a row's new
        document begins: from there on the row continues as a fresh state would, at position
        0 (rho and all earlier tokens dropped), and the state after the call holds only its
        last document. The summary memory takes resets at the call's first token only.
        """
        batch, seq_len = idx.shape
        for name, mask in (("summary_event_mask", summary_event_mask), ("reset_mask", reset_mask)):
            if mask is not None and mask.shape != idx.shape:
                raise ValueError(
                    f"{name} must have the tokens' shape {tuple(idx.shape)}, got "
                    f"{tuple(mask.shape)}"
                )
        need_state = state is not None
        if state is None:
            state = self.init_state(batch)
        layers = range(self.config.n_layer) if layers is None else layers
        positions = token_positions(state.position, seq_len, reset_mask)
        if reset_mask is not None:
            reset_mask = self._resets_inside_the_call(state, reset_mask, layers)
        if u is None:
            u = self.embed_tokens(idx)
        u = u.view(batch, 1, seq_len, self.config.n_embd)
        terms = self._position_terms(positions, u.dtype)
        for layer_index in layers:
            u = self.layer(
                u,
                layer_index,
                state,
                terms,
                executor,
                need_state,
                summary_event_mask,
                reset_mask,
            )
        if need_state and layers.stop == self.config.n_layer and seq_len:
            state.position = positions[:, -1] + 1
        return u.view(batch, seq_len, self.config.n_embd)

    def _resets_inside_the_call(
        self, state: ModelState, reset_mask: torch.Tensor, layers: range
    ) -> torch.Tensor | None:
        """The part of `reset_mask` the mixer must apply: None when every reset is at the
        call's first token. Such resets zero those rows' whole state before the first of
        `layers` runs (the mixer would drop the same state token by token), which lets the
        mixer run all its chunks at once.

        With a summary memory, resets can only be applied at the first token (its chunks
        follow absolute positions from the call's start): a later one is refused. Without
        one, a call that covers only some layers (a pipeline stage) keeps its mask."""
        later = bool(reset_mask[:, 1:].any())
        if later and self._summary_layers:
            raise ValueError(
                "the summary memory cannot reset a row in the middle of a call: its chunks "
                "follow absolute positions; cut the call at each document start instead"
            )
        whole_model = layers.start == 0 and layers.stop == self.config.n_layer
        if later or not (whole_model or self._summary_layers):
            return reset_mask
        if layers.start == 0:
            state.reset_(reset_mask[:, 0])
        return None

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token logits [..., V]. The NCA head has none, so it cannot sample (generate) either."""
        if self.config.language_head.type != "token":
            raise ValueError(
                f"the {self.config.language_head.type!r} head has no flat token logits, so "
                "logits and generation are unavailable; use loss_from_hidden"
            )
        return hidden @ self.lm_head

    def loss_from_hidden(
        self, hidden: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
    ) -> torch.Tensor:
        """Loss over counted targets (!= IGNORE_INDEX); reduction 'mean' or 'sum'."""
        head = self.config.language_head
        if head.type == "nca_factorized_patch":
            special = getattr(self, "nca_special_head", None)
            return nca_factorized_loss(hidden, targets, self.nca_lm_head, special, head, reduction)
        return token_cross_entropy(self.logits_from_hidden(hidden), targets, reduction)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        state: ModelState | None = None,
        summary_event_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, mean loss or None). The NCA head has no logits: (None, loss)."""
        hidden = self.forward_hidden(idx, state, summary_event_mask=summary_event_mask)
        if self.config.language_head.type != "token":
            loss = None if targets is None else self.loss_from_hidden(hidden, targets)
            return None, loss
        logits = self.logits_from_hidden(hidden)
        loss = None if targets is None else token_cross_entropy(logits, targets)
        return logits, loss


def _default_rope_freqs(module: BDH, state_dict, prefix: str, *args) -> None:
    """A state_dict without the rope table (written before the model kept one) loads the
    table every such model had: `rope_frequencies(N)`."""
    key = prefix + ROPE_FREQS
    if key not in state_dict:
        state_dict[key] = rope_frequencies(module.config.n_neurons)


def previous_tokens(
    u: torch.Tensor, last: torch.Tensor | None, reset_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The token shift's input: for a layer's input u [B, 1, T, D], u at each token's previous
    token, [B, 1, T, D]. The call's first token takes `last` (the layer's input at the last
    token the state read [B, 1, 1, D]; None: zeros, a fresh state), and a token where
    `reset_mask` [B, T] is True starts a document, so it takes zeros."""
    before = u.new_zeros(u.shape[0], 1, 1, u.shape[3]) if last is None else last
    shifted = torch.cat([before.to(u.dtype), u[:, :, :-1]], dim=2)
    if reset_mask is None:
        return shifted
    starts = reset_mask.to(device=u.device, dtype=torch.bool).view(u.shape[0], 1, -1, 1)
    return shifted.masked_fill(starts, 0.0)


def token_positions(
    start: torch.Tensor, seq_len: int, reset_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Absolute positions [B, T] of a call's tokens: row b continues from start[b], and a
    token where `reset_mask` [B, T] is True starts a new document at position 0."""
    offsets = torch.arange(seq_len, device=start.device)
    positions = start.unsqueeze(1) + offsets
    if reset_mask is None:
        return positions
    reset_mask = reset_mask.to(device=start.device, dtype=torch.bool)
    last_reset = torch.where(reset_mask, offsets, -1).cummax(dim=1).values
    return torch.where(last_reset >= 0, offsets - last_reset, positions)
