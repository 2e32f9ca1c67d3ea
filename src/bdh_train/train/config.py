"""`[training]`: the loop's settings — block and batch shape, TBPTT and streaming, gradient
accumulation, intervals, device and precision, gradient scales."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from bdh_train import checks
from bdh_train.data.loaders import logical_length_for
from bdh_train.errors import ConfigError
from bdh_train.model.bdh import COMPILE_MODES, RECOMPUTE_MODES
from bdh_train.train.allocator import HOST_ALLOCATORS
from bdh_train.train.init_from import InitTransferConfig
from bdh_train.train.profile import PROFILE_MODES
from bdh_train.train.schedules import GradientScale, validate_gradient_scales

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "auto")
STREAM_DOCUMENTS = ("fixed", "corpus")


ONEDNN_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""oneDNN's environment variables that cap the instruction sets its kernels use, the first
one set deciding (its older name second)."""
ONEDNN_LEVELS_BELOW_AMX = frozenset(
    {
        "SSE41",
        "AVX",
        "AVX2",
        "AVX2_VNNI",
        "AVX2_VNNI_2",
        "AVX512_CORE",
        "AVX512_CORE_VNNI",
        "AVX512_CORE_BF16",
        "AVX512_CORE_FP16",
        "AVX10_1_512",
        "AVX10_2_512",
    }
)
"""The ISA caps oneDNN knows that leave AMX out (it reads them case-insensitively)."""


def onednn_allows_amx(environ: Mapping[str, str] | None = None) -> bool:
    """Whether oneDNN may run its products in AMX tiles: no ISA cap in `environ` (default this
    process's environment) names a level below AMX. A value oneDNN does not know (DEFAULT,
    ALL, a misspelling) is no cap to it, so AMX stays allowed."""
    env = os.environ if environ is None else environ
    cap = next((env[name] for name in ONEDNN_ISA_CAPS if env.get(name)), "")
    return cap.strip().upper() not in ONEDNN_LEVELS_BELOW_AMX


def cpu_has_bfloat16_tiles() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in AMX tiles (Intel Xeon since Sapphire
    Rapids): torch's reading of the CPU's flags, unless oneDNN's ISA cap keeps AMX off
    (`onednn_allows_amx`). On one, the tiny preset trained 1.55x faster under bfloat16
    autocast (its 1024-square product 3.4-3.9x), to the same loss on the validation split's
    first 8 batches (1.4565 against 1.4567); with AMX capped off (AVX-512's bfloat16 dot
    products alone) it ran 0.87x as fast: docs/benchmarks.md, "bfloat16 on a CPU with AMX"."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe()) and onednn_allows_amx()


@dataclass
class TrainingConfig:
    """The train loop. An interval (``*_every``) of 0 disables that action."""

    RENAMED: ClassVar[dict[str, str]] = {"module_lr_scales": "gradient_scales"}
    """Old key -> new key: the old key is still read, with a deprecation line."""

    block_size: int = 512
    """Tokens per row of one micro-batch."""
    batch_size: int = 32
    """Rows per micro-batch, over all data-parallel processes together."""
    tbptt_chunk_size: int = 0
    """Truncated BPTT chunk length inside a block; 0 = off (backprop the whole block). A value
    >= block_size also means off: validation sets it to 0 and says so on stderr."""
    tbptt_backprop_chunks: int = 1
    """How many consecutive chunks one backward pass spans."""
    tbptt_persist_across_steps: bool = False
    """Carry the recurrent state from one optimizer step's block to the next (streaming)."""
    min_logical_block_size: int = 0
    """Logical sequence length streamed over consecutive blocks; 0 = block_size. Documents are
    whole blocks, so validation rounds it up to a multiple of block_size (saying so). Only for
    stream_documents = 'fixed'."""
    stream_documents: str = "fixed"
    """What a streamed document is. 'fixed': consecutive slices of min_logical_block_size
    tokens, each starting at a block's first token. 'corpus': the data's own documents (its
    document starts, or the tokens after each end-of-document id; an error when it has
    neither): rows read them in a seeded order, one after another, and a row's state is reset
    exactly at the token where its next document begins, mid-block included, with the target
    that would predict that token from the previous document ignored. 'corpus' streams
    (it implies carrying the state) and needs min_logical_block_size = 0, no summary memory and
    no pipeline."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (unless target_tokens_per_step derives it)."""
    target_tokens_per_step: int = 0
    """Tokens per optimizer step; 0 = unset. When set, the accumulation count is derived."""
    max_steps: int = 3000
    """Optimizer steps of the run (derived from max_tokens when that is set)."""
    max_tokens: int = 0
    """The run's length in tokens; 0 = unset. When set, validation sets max_steps to
    ceil(max_tokens / tokens per optimizer step) (saying so when that changes it), so the
    learning-rate schedule spans the token budget."""
    max_time: float | str = 0
    """A training-time budget: seconds, or hours/minutes/seconds such as '2h30m', '90m' or
    '45s'; 0 = none. The time is the training loop's wall clock summed over the run's sessions
    (a resume continues the sum; start-up and the final sample are not counted). Once it is
    spent, the run stops after the optimizer step in progress with a checkpoint, as a stop
    request does (exit status 75), and resumes from it exactly; the schedule still spans
    max_steps, so a wsd run stopped in its stable phase can go on or decay later."""
    peak_flops: float = 0.0
    """One device's peak FLOP/s, the MFU's denominator; 0 = measured at the start of the run
    (the best of three square matrix products in the run's dtype, 1024 on the CPU and 8192 on
    CUDA: train/throughput.py). Set a datasheet figure to compare with other tools' MFU."""
    seed: int = 1337
    """Seed of the initial weights and the batch order."""
    log_every: int = 100
    """Print and record the train loss every this many optimizer steps, at the first and at
    the last."""
    eval_every: int = 500
    """Evaluate on the validation split every this many optimizer steps."""
    eval_steps: int = 20
    """Validation batches per evaluation."""
    eval_activity: bool = True
    """Record the neurons' activity on the evaluation's own forwards (shares of positive x, y
    and x*y, dead and always-on neurons, per layer) into the evaluation's metrics row; it
    leaves training unchanged."""
    checkpoint_every: int = 1000
    """Write a checkpoint every this many optimizer steps."""
    keep_checkpoints: int = 3
    """How many periodic checkpoints to keep; 0 keeps all."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu' or 'cuda'."""
    threads: int = 0
    """CPU threads torch uses (torch.set_num_threads at the start of the run), at most the
    machine's CPUs; 0 = automatic: the cores other work leaves free (from the load average),
    at least 1 and at most torch's default of one per core, or OMP_NUM_THREADS when that is
    set. The start banner says what it chose. On a busy machine fewer threads are much
    faster."""
    host_allocator: str = "auto"
    """Host memory policy: 'retain' keeps freed memory in malloc's heap for the next step
    instead of unmapping it (glibc; CPU training ran 1.65-1.8x faster without re-faulting
    activation pages each step, at a peak resident set up to 1.7x higher); 'system' leaves
    malloc as it is; 'auto' = 'retain' for CPU training under glibc unless recompute is on,
    else 'system'. It applies to the whole training process."""
    dtype: str = "float32"
    """'float32'; 'bfloat16' autocast (products in bfloat16, float32 master weights); or
    'auto': bfloat16 autocast on a CUDA device with bfloat16 arithmetic and on a CPU with
    bfloat16 matrix units (AMX) that oneDNN may use (ONEDNN_MAX_CPU_ISA), float32 everywhere
    else (`bfloat16_autocast`). The start banner's device line says which it is."""
    compile: str = "off"
    """What torch.compile builds for training: 'off'; 'layer': the whole shared layer, one
    graph; 'pointwise': only the layer's gate y = x * relu(pre), as two fused kernels with
    bit-identical results; 'auto': the one measured faster on the run's device ('layer' on
    CUDA, 'pointwise' on the CPU). true reads as 'auto', false as 'off'."""
    recompute: str = "none"
    """What backward recomputes instead of keeping (activation checkpointing): 'none';
    'layer': each layer call keeps only its input and state and runs again in backward (about
    one more forward per step, the least activation memory); 'mixer': only the linear
    attention runs again (its score matrices are not kept). Gradients are unchanged, dropout
    included; evaluation and generation are not affected."""
    max_consecutive_skips: int = 5
    """Abort after this many consecutive steps skipped for non-finite loss/gradients."""
    profile: str = "off"
    """'off'; 'step': forward/backward time per optimizer step in metrics.jsonl; 'detail': also
    timed probes (embedding, first layer, head, whole model), extra passes that leave training
    unchanged. true/false (older configs) read as 'step'/'off'. BDH_PROFILE or
    BDH_PROFILE_DETAIL in the environment override it for one run. See `bdh-train profile`."""
    profile_memory: bool = False
    """Memory readings before each step, after its forward and after its backward (in-use
    bytes, and reserved bytes on CUDA); turns on 'step' profiling if it is off.
    BDH_PROFILE_MEMORY overrides it for one run."""
    gradient_scales: list[GradientScale] = field(default_factory=list)
    """Gradient multipliers per parameter group (not learning-rate changes); their ramps count
    optimizer steps of max_steps, an accumulation window of micro-batches being one step."""
    init_transfer: InitTransferConfig = field(default_factory=InitTransferConfig)
    """How weights loaded with checkpoint.init_from are treated in the first steps."""

    @property
    def logical_block_size(self) -> int:
        """The logical sequence length: min_logical_block_size rounded up to a multiple of
        block_size (block_size when 0)."""
        return logical_length_for(self.min_logical_block_size, self.block_size)

    @property
    def streaming(self) -> bool:
        """Whether recurrent state flows across blocks (persisted or logical > block)."""
        return (
            self.tbptt_persist_across_steps
            or self.logical_block_size > self.block_size
            or self.stream_documents == "corpus"
        )

    def recurrence(self) -> str | None:
        """What carries the recurrent state and its gradients past a block, in words (the
        start banner's); None when neither TBPTT nor streaming is on."""
        parts = []
        if self.tbptt_chunk_size:
            chunks = self.tbptt_backprop_chunks
            parts.append(
                f"TBPTT: backward through {chunks} chunk{'s' if chunks > 1 else ''} of "
                f"{self.tbptt_chunk_size} tokens at a time"
            )
        if self.stream_documents == "corpus":
            parts.append(
                "streaming: each row reads the corpus's documents in turn, its state carried "
                "across steps and reset where a document begins"
            )
        elif self.logical_block_size > self.block_size:
            parts.append(
                f"streaming: state carried across the blocks of {self.logical_block_size}-token "
                "documents"
            )
        elif self.tbptt_persist_across_steps:
            parts.append("streaming: state carried from each step's block to the next")
        return "; ".join(parts) or None

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step, derived from target_tokens_per_step when set."""
        if self.target_tokens_per_step:
            return self.target_tokens_per_step // (self.block_size * self.batch_size)
        return self.gradient_accumulation_steps

    @property
    def time_budget_s(self) -> float:
        """max_time in seconds (0: no budget)."""
        return checks.duration("training.max_time", self.max_time)

    @property
    def tokens_per_step(self) -> int:
        return self.accumulation_steps * self.block_size * self.batch_size

    def bfloat16_autocast(self, device_type: str) -> bool:
        """Whether training on `device_type` runs under bfloat16 autocast: dtype 'bfloat16',
        or 'auto' on a CUDA device that has bfloat16 arithmetic (not one that emulates it,
        as GPUs before Ampere do) or on a CPU with AMX tiles (`cpu_has_bfloat16_tiles`).
        Other CPUs are float32 under 'auto': without bfloat16 instructions (AVX2) their
        bfloat16 products are emulated, and the small preset trained 60x slower there (4
        tokens a second against 250)."""
        if self.dtype != "auto":
            return self.dtype == "bfloat16"
        if device_type == "cpu":
            return cpu_has_bfloat16_tiles()
        cuda = device_type == "cuda" and torch.cuda.is_available()
        return cuda and torch.cuda.is_bf16_supported(including_emulation=False)

    def precision(self, device_type: str) -> str:
        """What training's products run in on `device_type`, in words ('float32', 'bfloat16
        autocast'), with "(dtype 'auto')" where 'auto' chose it."""
        chosen = "bfloat16 autocast" if self.bfloat16_autocast(device_type) else "float32"
        return f"{chosen} (dtype 'auto')" if self.dtype == "auto" else chosen

    def validate(self, prefix: str = "training") -> TrainingConfig:
        p = prefix
        checks.positive_int(f"{p}.block_size", self.block_size)
        checks.positive_int(f"{p}.batch_size", self.batch_size)
        checks.nonneg_int(f"{p}.tbptt_chunk_size", self.tbptt_chunk_size)
        checks.positive_int(f"{p}.tbptt_backprop_chunks", self.tbptt_backprop_chunks)
        checks.boolean(f"{p}.tbptt_persist_across_steps", self.tbptt_persist_across_steps)
        checks.nonneg_int(f"{p}.min_logical_block_size", self.min_logical_block_size)
        checks.choice(f"{p}.stream_documents", self.stream_documents, STREAM_DOCUMENTS)
        if self.stream_documents == "corpus" and self.min_logical_block_size:
            raise ConfigError(
                f"{p}.min_logical_block_size = {self.min_logical_block_size} cuts the stream "
                f"into fixed-length documents, but {p}.stream_documents = 'corpus' streams the "
                f"corpus's own documents; set {p}.min_logical_block_size = 0 or "
                f"{p}.stream_documents = 'fixed'"
            )
        checks.positive_int(f"{p}.gradient_accumulation_steps", self.gradient_accumulation_steps)
        checks.nonneg_int(f"{p}.target_tokens_per_step", self.target_tokens_per_step)
        checks.positive_int(f"{p}.max_steps", self.max_steps)
        checks.nonneg_int(f"{p}.max_tokens", self.max_tokens)
        checks.duration(f"{p}.max_time", self.max_time)
        checks.number(f"{p}.peak_flops", self.peak_flops, low=0.0)
        checks.nonneg_int(f"{p}.seed", self.seed)
        for name in ("log_every", "eval_every", "checkpoint_every"):
            checks.interval(f"{p}.{name}", getattr(self, name))
        checks.positive_int(f"{p}.eval_steps", self.eval_steps)
        checks.nonneg_int(f"{p}.keep_checkpoints", self.keep_checkpoints)
        checks.choice(f"{p}.device", self.device, DEVICES)
        checks.cpu_threads(f"{p}.threads", self.threads)
        checks.choice(f"{p}.host_allocator", self.host_allocator, HOST_ALLOCATORS)
        checks.choice(f"{p}.dtype", self.dtype, DTYPES)
        if isinstance(self.compile, bool):
            self.compile = "auto" if self.compile else "off"
        checks.choice(f"{p}.compile", self.compile, COMPILE_MODES)
        checks.choice(f"{p}.recompute", self.recompute, RECOMPUTE_MODES)
        checks.nonneg_int(f"{p}.max_consecutive_skips", self.max_consecutive_skips)
        if isinstance(self.profile, bool):
            self.profile = "step" if self.profile else "off"
        checks.choice(f"{p}.profile", self.profile, PROFILE_MODES)
        checks.boolean(f"{p}.profile_memory", self.profile_memory)
        checks.boolean(f"{p}.eval_activity", self.eval_activity)

        self._normalise_lengths(p)
        if self.target_tokens_per_step:
            if self.gradient_accumulation_steps != 1:
                raise ConfigError(
                    f"set either {p}.target_tokens_per_step or "
                    f"{p}.gradient_accumulation_steps, not both (got "
                    f"{self.target_tokens_per_step} and {self.gradient_accumulation_steps})"
                )
            micro = self.block_size * self.batch_size
            checks.multiple_of(
                f"{p}.target_tokens_per_step",
                self.target_tokens_per_step,
                micro,
                f"{p}.block_size * {p}.batch_size",
                zero_ok=False,
            )
        if self.max_tokens:
            steps = -(-self.max_tokens // self.tokens_per_step)
            if steps != self.max_steps:
                _info(
                    f"{p}.max_steps = {steps}: {p}.max_tokens = {self.max_tokens:,} at "
                    f"{self.tokens_per_step:,} tokens per optimizer step"
                )
                self.max_steps = steps
        validate_gradient_scales(self.gradient_scales, f"{p}.gradient_scales")
        self.init_transfer.validate(f"{p}.init_transfer")
        return self

    def _normalise_lengths(self, p: str) -> None:
        """Write the effective TBPTT chunk and logical length into the fields, with one info
        line on stderr for each value changed. Idempotent: a config validated (and dumped)
        once validates again unchanged and silently, e.g. on resume."""
        if self.tbptt_chunk_size >= self.block_size:
            _info(
                f"{p}.tbptt_chunk_size={self.tbptt_chunk_size} >= {p}.block_size="
                f"{self.block_size}: no TBPTT chunking (tbptt_chunk_size set to 0)"
            )
            self.tbptt_chunk_size = 0
        if self.min_logical_block_size % self.block_size:
            rounded = logical_length_for(self.min_logical_block_size, self.block_size)
            _info(
                f"{p}.min_logical_block_size={self.min_logical_block_size} rounded up to "
                f"{rounded}, a multiple of {p}.block_size={self.block_size}"
            )
            self.min_logical_block_size = rounded


def _info(message: str) -> None:
    print(f"info: {message}", file=sys.stderr)


def every_and_last(step: int, every: int, last: int) -> bool:
    """Whether optimizer step `step` is due for what happens every `every` steps and at the
    last one (`last`); never with `every` = 0."""
    return bool(every) and (step % every == 0 or step == last)
