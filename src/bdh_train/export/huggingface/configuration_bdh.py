"""The configuration of a Dragon Hatchling (BDH) language model exported by bdh-train for
Hugging Face transformers (`AutoConfig` with trust_remote_code=True). Needs only transformers."""

from __future__ import annotations

from transformers import PretrainedConfig

POSITIONS = ("rope", "alibi", "alibi_learned", "alibi_spread", "alibi_slow")
NORMS = ("layernorm", "layernorm_affine")
PROJECTIONS = ("encoder", "encoder_v", "decoder")


class BDHConfig(PretrainedConfig):
    """BDH's sizes and options: n_layer applications of one shared layer over a residual
    stream of n_embd, n_head heads of n_neurons neurons each, positions by rope (rotated
    queries, frequencies stored with the weights) or alibi (a per-head state decay), layer
    norms without or with (one shared) affine scale and bias. The projections named in
    quant_targets were trained quantized (BitNet b1.58): the weights file holds their
    quantized values, and their inputs are rounded to int8, one scale per token. Under
    token_shift each layer's encoder reads the token's input plus its previous real token's."""

    model_type = "bdh"
    attribute_map = {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
    }

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 6,
        n_embd: int = 256,
        n_head: int = 4,
        n_neurons: int = 8192,
        position: str = "rope",
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        prefill_chunk: int = 256,
        quant_targets: list[str] | None = None,
        token_shift: bool = False,
        **kwargs,
    ) -> None:
        if position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {position!r}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        quant_targets = list(quant_targets or [])
        if not set(quant_targets) <= set(PROJECTIONS):
            raise ValueError(f"quant_targets must be drawn from {PROJECTIONS}, got {quant_targets}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.vocab_size = vocab_size
        self.n_layer = n_layer
        self.n_embd = n_embd
        self.n_head = n_head
        self.n_neurons = n_neurons
        self.position = position
        self.norm = norm
        self.norm_eps = norm_eps
        self.prefill_chunk = prefill_chunk
        """Tokens read per block of a long input: the state carries one block to the next,
        so memory grows with this, not with the input."""
        self.quant_targets = quant_targets
        self.token_shift = bool(token_shift)
        """Each layer's encoder reads u_t + u_(t-1), the previous real token's input (zeros
        before a fresh cache's first token); no parameters."""
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
