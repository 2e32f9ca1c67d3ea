"""BDHConfig: the model's hyper-parameters and their validation, with the quantization and
output-head options it holds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from bdh_train import checks
from bdh_train.errors import ConfigError
from bdh_train.model import mixer
from bdh_train.utils import build_dataclass

POSITIONS = ("rope", "alibi", "alibi_learned", "alibi_spread", "alibi_slow")
NORMS = ("layernorm", "layernorm_affine")
EXECUTORS = ("auto", *mixer.EXECUTORS)
WEIGHT_FORMATS = ("ternary158", "ternary_threshold", "int8")
ACT_FORMATS = ("int8", "int8_tensor_mean")
QUANT_TARGETS = ("decoder_x", "decoder_y", "encoder")
TRAINING_MODES = ("qat_ste", "train_kernel")
SAVED_ACTIVATIONS = ("none", "quantized_cache_recompute")
HEAD_TYPES = ("token", "nca_factorized_patch")
MAX_PARAMETERS = 10**11
"""The most parameters a config may ask for (400 GB in float32): sizes from a config or a
checkpoint's metadata are checked against it before anything is allocated."""


@dataclass
class QuantConfig:
    """BitNet b1.58 quantization-aware training options."""

    enable: bool = False
    """Quantize the projections named in target_modules."""
    weight_format: str = "ternary158"
    """'ternary158' (round W / mean|W| to -1, 0, +1), 'ternary_threshold' (sign(W) where |W| >=
    mean|W|, else 0) or 'int8'."""
    act_format: str = "int8"
    """'int8' (one scale per token) or 'int8_tensor_mean' (one scale per tensor)."""
    target_modules: list[str] = field(default_factory=lambda: list(QUANT_TARGETS))
    """Which projections to quantize."""
    training_mode: str = "qat_ste"
    """'qat_ste' (fake quantization, straight-through gradients) or 'train_kernel' (integer matmul
    forward, fake-quant gradients)."""
    saved_activations: str = "none"
    """'none', or 'quantized_cache_recompute' (train_kernel only): backward keeps int8 input codes
    instead of a float copy."""
    warmup_steps: int = 0
    """Steps over which quantization ramps in from 0 to full (0 = fully quantized from the first
    step)."""

    def validate(self, prefix: str = "model.quant") -> None:
        checks.boolean(f"{prefix}.enable", self.enable)
        checks.choice(f"{prefix}.weight_format", self.weight_format, WEIGHT_FORMATS)
        checks.choice(f"{prefix}.act_format", self.act_format, ACT_FORMATS)
        if not isinstance(self.target_modules, (list, tuple)) or not self.target_modules:
            raise ConfigError(
                f"{prefix}.target_modules must be a non-empty list drawn from "
                f"{', '.join(map(repr, QUANT_TARGETS))}, got {self.target_modules!r}"
            )
        for t in self.target_modules:
            checks.choice(f"{prefix}.target_modules[]", t, QUANT_TARGETS)
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ConfigError(
                f"{prefix}.target_modules lists a module twice, got {self.target_modules!r}"
            )
        checks.choice(f"{prefix}.training_mode", self.training_mode, TRAINING_MODES)
        checks.choice(f"{prefix}.saved_activations", self.saved_activations, SAVED_ACTIVATIONS)
        if self.saved_activations != "none" and self.training_mode != "train_kernel":
            raise ConfigError(
                f"{prefix}.saved_activations={self.saved_activations!r} needs "
                f"{prefix}.training_mode='train_kernel', got {self.training_mode!r}"
            )
        checks.nonneg_int(f"{prefix}.warmup_steps", self.warmup_steps)


@dataclass
class LanguageHeadConfig:
    """The output head: plain token logits, or the NCA factorized patch head."""

    type: str = "token"
    """'token' (logits over vocab_size) or 'nca_factorized_patch' (one state distribution per cell
    of an NCA patch)."""
    state_count: int = 2
    """NCA head: states per cell (must equal data.nca.state_count)."""
    patch_size: int = 1
    """NCA head: cells per patch side (must equal data.nca.patch_size)."""
    frame_special_tokens: bool = False
    """NCA head: the two ids after the patches mark frame starts and ends."""
    eos_id: int | None = None
    """NCA head: the end-of-sequence id (>= the patch vocabulary); None = none."""

    def validate(self, vocab_size: int, prefix: str = "model.language_head") -> None:
        checks.choice(f"{prefix}.type", self.type, HEAD_TYPES)
        if self.type == "token":
            return
        checks.int_at_least(f"{prefix}.state_count", self.state_count, 2)
        checks.positive_int(f"{prefix}.patch_size", self.patch_size)
        checks.boolean(f"{prefix}.frame_special_tokens", self.frame_special_tokens)
        if self.eos_id is not None:
            checks.nonneg_int(f"{prefix}.eos_id", self.eos_id)
            if self.eos_id < self.patch_vocab:
                raise ConfigError(
                    f"{prefix}.eos_id must be >= the patch vocabulary {self.patch_vocab} "
                    f"(ids 0..{self.patch_vocab - 1} are patches), got {self.eos_id}"
                )
        needed = self.patch_vocab + len(self.special_tokens)
        if vocab_size < needed:
            raise ConfigError(
                f"model.vocab_size must be >= {needed} (patch vocabulary {self.patch_vocab} + "
                f"{len(self.special_tokens)} special tokens) for {prefix}, got {vocab_size}"
            )
        if self.eos_id is not None and self.eos_id >= vocab_size:
            raise ConfigError(
                f"{prefix}.eos_id must be < model.vocab_size ({vocab_size}), got {self.eos_id}"
            )

    @property
    def cells(self) -> int:
        return self.patch_size * self.patch_size

    @property
    def patch_vocab(self) -> int:
        return self.state_count**self.cells

    @property
    def special_tokens(self) -> list[int]:
        specials = [self.patch_vocab, self.patch_vocab + 1] if self.frame_special_tokens else []
        if self.eos_id is not None and self.eos_id not in specials:
            specials.append(self.eos_id)
        return specials


@dataclass
class SummaryMemoryConfig:
    """Summary memory: a per-layer running summary of past chunks of the layer input, added
    back to the input of later chunks (off by default)."""

    enabled: bool = False
    """Add the summary memory branch to the layers chosen by last_layers."""
    last_layers: int | None = None
    """How many of the last layers carry a memory; None = every layer."""
    chunk_tokens: int = 32
    """Tokens per summarised chunk; chunks are aligned to each row's absolute position."""
    residual_scale: float = 0.25
    """Weight of the memory added to every token of the next chunks' layer input."""
    state_decay: float = 0.75
    """Share of the old memory kept at each chunk's update."""
    state_update_scale: float = 0.5
    """Weight of the chunk's mean layer input in each update."""
    surprise_gate_threshold: float = 0.0
    """Mean |chunk mean - memory| below which an update is suppressed; 0 = no surprise gate."""
    surprise_gate_sharpness: float = 8.0
    """Slope of the surprise gate above its threshold."""
    write_gate: bool = False
    """Write the memory only at chunks holding a summary event (data.summary_write_trigger_*)."""

    def validate(self, n_layer: int, prefix: str = "model.summary_memory") -> None:
        checks.boolean(f"{prefix}.enabled", self.enabled)
        if self.last_layers is not None:
            checks.int_in(f"{prefix}.last_layers", self.last_layers, 1, n_layer, "model.n_layer")
        checks.positive_int(f"{prefix}.chunk_tokens", self.chunk_tokens)
        checks.number(f"{prefix}.residual_scale", self.residual_scale, low=0.0)
        checks.number(f"{prefix}.state_decay", self.state_decay, low=0.0, high=1.0, high_open=False)
        checks.number(f"{prefix}.state_update_scale", self.state_update_scale, low=0.0)
        checks.number(f"{prefix}.surprise_gate_threshold", self.surprise_gate_threshold, low=0.0)
        checks.number(
            f"{prefix}.surprise_gate_sharpness",
            self.surprise_gate_sharpness,
            low=0.0,
            low_open=True,
        )
        checks.boolean(f"{prefix}.write_gate", self.write_gate)
        if self.write_gate and not self.enabled:
            raise ConfigError(
                f"{prefix}.write_gate=true needs {prefix}.enabled=true (the gate decides when "
                "the summary memory is written)"
            )

    def layers(self, n_layer: int) -> range:
        """The layers with a summary memory (empty when disabled)."""
        if not self.enabled:
            return range(0)
        return range(n_layer - (self.last_layers or n_layer), n_layer)


def head_parameter_shapes(config: BDHConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the output-head parameters this config creates (all init N(0, 0.02))."""
    head, d = config.language_head, config.n_embd
    if head.type == "token":
        return {"lm_head": (d, config.vocab_size)}
    shapes: dict[str, tuple[int, ...]] = {"nca_lm_head": (d, head.cells * head.state_count)}
    if head.special_tokens:
        shapes["nca_special_head"] = (d, len(head.special_tokens))
    return shapes


@dataclass
class BDHConfig:
    """Hyper-parameters of a BDH model. Defaults are those of the official pathwaycom/bdh model."""

    n_layer: int = 6
    """Layers; all share one set of weights (BDH's recurrence in depth)."""
    n_embd: int = 256
    """D: width of the residual stream (the low-rank side)."""
    n_head: int = 4
    """H: heads; each has n_embd * mlp_internal_dim_multiplier / n_head neurons."""
    mlp_internal_dim_multiplier: int = 128
    """Neurons per layer (all heads) as a multiple of n_embd."""
    vocab_size: int = 256
    """Token ids 0..vocab_size-1; 256 for byte text."""
    dropout: float = 0.1
    """Dropout probability in training (0 = none)."""
    position: str = "rope"
    """'rope' (rotated queries), 'alibi' (fixed per-head state decay, burn_dragon's rates
    2^(-h/H): memories of one or two tokens), 'alibi_learned' (the same decay, each head's rate
    a parameter starting at alibi's), 'alibi_spread' (fixed decay at ALiBi's own rates
    2^(-8(h+1)/H): for 4 heads, memories of 4, 16, 64 and 256 tokens) or 'alibi_slow'
    (alibi's rates on every head but the last, which remembers 16 tokens: rate 1/16)."""
    token_shift: bool = False
    """The encoder reads each token's layer input plus the previous token's (u_t + u_{t-1};
    zero before a document's first token), so a neuron can fire for a token pair: what
    associative recall needs to store "key -> value" at the value (a short causal convolution
    of width 2 without weights, as RWKV's token shift and the short convolutions of H3 and
    Based). No parameters; off in the official model."""
    norm: str = "layernorm"
    """'layernorm' (no learned scale or bias, as the official model) or 'layernorm_affine'."""
    executor: str = "auto"
    """How the linear attention runs: 'dense' (T x T matrix), 'chunked' (blocks of chunk_size),
    'recurrent' (token by token), or 'auto' (chosen by length); all give the same numbers."""
    chunk_size: int = 0
    """Tokens per chunk of the chunked executor; 0 = calibrated for the device the model runs
    on (128 on CPU and CUDA, measured: docs/benchmarks.md; 256 elsewhere)."""
    quant: QuantConfig = field(default_factory=QuantConfig)
    """BitNet b1.58 quantization-aware training of the three shared projections."""
    language_head: LanguageHeadConfig = field(default_factory=LanguageHeadConfig)
    """The output head."""
    summary_memory: SummaryMemoryConfig = field(default_factory=SummaryMemoryConfig)
    """Per-layer summary memory of past chunks (off by default)."""

    @property
    def n_neurons(self) -> int:
        """N: neurons per head = multiplier * D / H."""
        return self.mlp_internal_dim_multiplier * self.n_embd // self.n_head

    def parameter_count(self) -> int:
        """Parameters the model will hold, from the sizes alone (nothing is allocated)."""
        h, d, n = self.n_head, self.n_embd, self.n_neurons
        count = self.vocab_size * d + 3 * h * d * n  # embedding, encoder, encoder_v, decoder
        count += h if self.position == "alibi_learned" else 0
        count += 2 * d if self.norm == "layernorm_affine" else 0
        for shape in head_parameter_shapes(self).values():
            size = 1
            for extent in shape:
                size *= extent
            count += size
        return count

    def size_error(self, limit: str, prefix: str = "model") -> ConfigError:
        """The error for a model too large for `limit`, naming the key that makes it so (the
        vocabulary when the embedding and token head hold most of it)."""
        count = self.parameter_count()
        embedding = self.vocab_size * self.n_embd
        key = "vocab_size" if 4 * embedding >= count else "mlp_internal_dim_multiplier"
        return ConfigError(
            f"{prefix}.{key}={getattr(self, key)} (with {prefix}.n_embd={self.n_embd}, "
            f"{prefix}.n_head={self.n_head}) makes a model of {count:.3g} parameters, more than "
            f"{limit}; lower {prefix}.{key}"
        )

    def _check_size(self, prefix: str) -> None:
        if self.parameter_count() > MAX_PARAMETERS:
            raise self.size_error(f"the {MAX_PARAMETERS:.0e} allowed", prefix)

    def validate(self, prefix: str = "model") -> BDHConfig:
        for name in (
            "n_layer",
            "n_embd",
            "n_head",
            "mlp_internal_dim_multiplier",
            "vocab_size",
        ):
            checks.positive_int(f"{prefix}.{name}", getattr(self, name))
        checks.nonneg_int(f"{prefix}.chunk_size", self.chunk_size)
        if (self.mlp_internal_dim_multiplier * self.n_embd) % self.n_head:
            raise ConfigError(
                f"{prefix}.mlp_internal_dim_multiplier * {prefix}.n_embd must be divisible by "
                f"{prefix}.n_head ({self.n_head}), got "
                f"{self.mlp_internal_dim_multiplier} * {self.n_embd}"
            )
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"{prefix}.n_embd must be divisible by {prefix}.n_head ({self.n_head}), "
                f"got {self.n_embd}"
            )
        checks.number(f"{prefix}.dropout", self.dropout, low=0.0, high=1.0)
        checks.choice(f"{prefix}.position", self.position, POSITIONS)
        checks.boolean(f"{prefix}.token_shift", self.token_shift)
        checks.choice(f"{prefix}.norm", self.norm, NORMS)
        checks.choice(f"{prefix}.executor", self.executor, EXECUTORS)
        self.quant.validate(f"{prefix}.quant")
        self.language_head.validate(self.vocab_size, f"{prefix}.language_head")
        self.summary_memory.validate(self.n_layer, f"{prefix}.summary_memory")
        self._check_size(prefix)
        q = self.quant
        if q.enable and q.weight_format == "int8" and q.training_mode == "train_kernel":
            # int8 x int8 products summed over K must fit the kernel's int32 accumulator
            k_max = max(self.n_embd, self.n_head * self.n_neurons)
            if 128 * 127 * k_max >= 2**31:
                raise ConfigError(
                    f"{prefix}.quant.weight_format='int8' with training_mode='train_kernel' "
                    f"overflows the int32 accumulator for a contraction of {k_max} "
                    "(n_head * n_neurons); use weight_format='ternary158' or "
                    "training_mode='qat_ste'"
                )
        if self.quant.enable and self.language_head.type != "token":
            raise ConfigError(
                f"{prefix}.quant.enable=true is not supported with "
                f"{prefix}.language_head.type={self.language_head.type!r}; "
                "disable quantization or use the token head"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], prefix: str = "model") -> BDHConfig:
        """Build and validate from a plain dict (e.g. a TOML table); unknown keys are errors."""
        return build_dataclass(cls, data, prefix).validate(prefix)
