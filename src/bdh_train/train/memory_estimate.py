"""A train step's peak memory, estimated from the config before anything is allocated, and
the check that refuses a run whose step would not fit in what this process may use
(`machine_memory`).

The estimate is the larger of two moments of one optimizer step (bytes; `StepMemory`):

* **backward**, at the last layer of the largest backward window (everything autograd keeps
  for that window is still held there): the parameters, the optimizer's state, the gradients
  (counted whole), the accumulator's pending sum when a window has several micro-batches,
  and the activations: what autograd keeps for the window (`_Piece.kept`, tensor by tensor
  from the layer's code) plus the largest workspace one layer's backward or the head's
  allocates on top (`_Piece.workspace`);
* **the optimizer step**: the parameters, the optimizer's state and the gradients, with the
  larger of what the accumulator holds as it writes them (its sum and normalised copy,
  `WeightedGradientAccumulator.finish_mean`, then `write_to_params`, and one parameter's
  temporary) and what the optimizer's update holds (`optimizer_memory`).

The optimizer's state is AdamW's two moments per parameter, or, with Muon, one momentum buffer
per matrix Muon updates (the encoders and the decoder) and AdamW's two moments for the rest.

The activations follow what the run will execute: the executor `executor = 'auto'` picks for
each forward piece's length on the device (`mixer.resolve_executor`, with the row panels the
CPU's dense executor computes its scores in), the recompute mode, the TBPTT chunk and how many
chunks one backward spans, the carried state, dropout's masks, rope's phases and the dtype
(bfloat16 autocast keeps the projections' outputs in 2 bytes). A data-parallel process holds
its share of the batch's rows; a pipeline stage its share of the layers. The figures were
checked against measured peaks (tests/train/test_memory.py, benchmarks/bench_step_memory.py);
quantization-aware training and the summary memory are counted as the plain layer, a
compiled layer as autograd's products.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bdh_train.model.bdh import compile_mode_for, state_shapes
from bdh_train.model.config import BDHConfig, head_parameter_shapes
from bdh_train.model.mixer import calibration_for, resolve_executor
from bdh_train.train.config import TrainingConfig
from bdh_train.train.muon import MUON_PARAMETERS

GIB = 1 << 30
MIB = 1 << 20
FLOAT32 = 4
"""Bytes of a float32: the accumulator's sums, the head's log-probabilities, the residual
stream's norms, rope's tables, and every activation outside bfloat16 autocast."""
BFLOAT16 = 2
MOMENTS = 2
"""AdamW keeps two moments per parameter (exp_avg, exp_avg_sq), each the parameter's size."""
MUON_BUFFERS = 1
"""Muon keeps one momentum buffer per matrix it updates, the matrix's size."""
OPTIMIZER_STATE = {
    "adamw": "AdamW's two moments",
    "muon": "Muon's momentum (encoders, decoder) and AdamW's two moments (the rest)",
}
"""What `optimizer_memory` counts as the state of each optimizer.name, in words."""
MUON_TEMPORARIES = 6
"""Tensors of one matrix's size that Muon's update of that matrix holds at its peak
(train/muon.py): 6.0 matrices measured on [4, 256, 2048] and [8192, 256] (the allocator's
events under torch's profiler, torch 2.13 on the CPU), one more than the five the code names
(the Nesterov look-ahead, the iterate, and inside a Newton-Schulz step a X, (b G + c G^2) X
and their sum, the next iterate; the Gram matrices G are [A, A], small beside them). With
BDH's three matrices of equal size this stays below the accumulator's two float32 sums."""


@dataclass(frozen=True)
class StepMemory:
    """A train step's estimated peak (bytes), split by what holds it, at the moment of the
    step that holds the most (`at`: 'backward' or 'the optimizer step')."""

    parameters: int
    gradients: int
    """`.grad`, with the accumulator's sum (and at the optimizer step the larger of its
    normalised copy with a parameter's temporary and the optimizer update's temporaries)."""
    optimizer: int
    activations: int
    """What autograd keeps for the backward window plus the workspace of the backward
    (0 at the optimizer step)."""
    rows: int
    block_size: int
    executor: str
    """What the mixer runs for the largest forward piece: 'dense', 'chunked/C', 'recurrent'."""
    at: str
    optimizer_name: str = "adamw"
    """The optimizer whose state `optimizer` counts: 'adamw' or 'muon'."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def summary(self) -> str:
        """'about 7.9 GiB (parameters 0.4, gradients 0.4, optimizer 0.8, activations 6.3 at
        batch 16 x block 512)', in MiB below 1 GiB."""
        unit, scale, places = ("GiB", GIB, 1) if self.total >= GIB else ("MiB", MIB, 0)
        parts = ", ".join(
            f"{name} {value / scale:.{places}f}"
            for name, value in (
                ("parameters", self.parameters),
                ("gradients", self.gradients),
                ("optimizer", self.optimizer),
                ("activations", self.activations),
            )
        )
        return (
            f"about {self.total / scale:.{places}f} {unit} ({parts} at batch {self.rows} x "
            f"block {self.block_size})"
        )


def format_bytes(count: int) -> str:
    """'7.9 GiB', or '312 MiB' below 1 GiB."""
    if count >= GIB:
        return f"{count / GIB:.1f} GiB"
    return f"{count / MIB:.0f} MiB"


# --------------------------------------------------------------------- activations
@dataclass(frozen=True)
class _Shape:
    """What the activation counts read: one process's rows and the model's sizes."""

    rows: int
    heads: int
    neurons: int
    embd: int
    vocab: int
    layers: int
    element: int
    """Bytes of a projection's output: 4, or 2 under bfloat16 autocast."""
    autocast: bool
    rope: bool
    dropout: bool
    function: bool
    """Whether dense and chunked run as the mixer's autograd Function (`ChunkedAttention`):
    outside autocast and a compiled layer, without a learned decay."""
    decay: bool
    resets: bool
    """Resets inside a forward call (stream_documents = 'corpus')."""
    device_type: str
    executor: str
    chunk_size: int


@dataclass(frozen=True)
class _Piece:
    """One forward piece (a TBPTT chunk, or the whole block) of `length` tokens."""

    shape: _Shape
    length: int
    reads_state: bool
    """Whether the piece starts from a carried state (rho0)."""

    # ------------------------------------------------------------------ sizes (bytes)
    def _executor(self) -> tuple[str, int]:
        s = self.shape
        panels = s.function and not s.decay and not s.resets
        return resolve_executor(
            s.executor,
            self.length,
            s.neurons,
            s.embd,
            s.chunk_size,
            s.device_type,
            torch.bfloat16 if s.autocast else torch.float32,
            dense_panels=panels,
        )

    @property
    def executor(self) -> str:
        name, chunk = self._executor()
        return f"chunked/{chunk}" if name == "chunked" else name

    def _chunks(self) -> tuple[int, int]:
        """(chunks K, chunk length C) of the mixer's call; dense is one chunk of the call."""
        name, chunk = self._executor()
        if name != "chunked":
            return 1, self.length
        return -(-self.length // chunk), chunk

    def _panel_rows(self) -> int:
        s = self.shape
        if not s.function or s.decay or s.resets or self._executor()[0] != "dense":
            return 0
        rows = calibration_for(s.device_type).dense_panel_rows
        return rows if 0 < rows < self.length else 0

    @property
    def neurons(self) -> int:
        """x [B, H, T, N] (and every tensor of its shape): relu(u @ encoder), the gate's
        relu(pre), the gate's output."""
        s = self.shape
        return s.rows * s.heads * self.length * s.neurons * s.element

    @property
    def padded_neurons(self) -> int:
        """The queries as the mixer saves them, zero-padded to whole chunks."""
        chunks, chunk = self._chunks()
        return self.neurons * chunks * chunk // self.length

    @property
    def values(self) -> int:
        """[B, H, T, D]: the mixer's output, its norm, the value copied to every head."""
        s = self.shape
        return s.rows * s.heads * self.length * s.embd * s.element

    @property
    def padded_values(self) -> int:
        chunks, chunk = self._chunks()
        return self.values * chunks * chunk // self.length

    @property
    def stream(self) -> int:
        """[B, T, D] in float32: the residual stream and its norms."""
        s = self.shape
        return s.rows * self.length * s.embd * FLOAT32

    @property
    def state(self) -> int:
        """One layer's rho [B, H, N, D]."""
        s = self.shape
        return s.rows * s.heads * s.neurons * s.embd * s.element

    def _scores(self) -> int:
        """The score matrices the mixer keeps: the panels below the diagonal (CPU dense),
        T x T, or one C x C per chunk."""
        s = self.shape
        per_row = s.rows * s.heads * s.element
        chunks, chunk = self._chunks()
        if self._executor()[0] == "recurrent":
            return 0
        panel = self._panel_rows()
        if panel:
            whole, rest = divmod(self.length, panel)
            pairs = panel * panel * whole * (whole + 1) // 2 + rest * self.length
            return per_row * pairs
        return per_row * chunks * chunk * chunk

    def _chunk_states(self) -> int:
        """The states S_k the chunked executor keeps ([B, H, K, N, D]; none for one chunk),
        or the recurrent executor's state after every token."""
        name = self._executor()[0]
        if name == "recurrent":
            return self.length * self.state
        chunks, _ = self._chunks()
        if not self.shape.function:  # autograd's products keep the writes W and the states S
            return 2 * chunks * self.state if chunks > 1 else 0
        return chunks * self.state if chunks > 1 else 0

    def mixer_kept(self) -> int:
        """What `BDH.mix` keeps for backward. The Function: the rotated (or padded) queries,
        the value copied per head, the scores (twice with resets and decay together: their
        product's score factor), the chunk states, its output (the norm's input) and the
        norm's statistics. Autograd's products (autocast, a learned decay)
        keep each product's operands, under autocast each one's bfloat16 copy (two of the
        queries for dense, three for chunked, which also reads and writes the states), with
        a decay the weighted queries and scores, and the value unexpanded."""
        s = self.shape
        chunks, _ = self._chunks()
        stats = 2 * s.rows * s.heads * self.length * FLOAT32
        scores = self._scores()
        values = 2 * self.padded_values
        if self._executor()[0] == "recurrent":
            queries = self.neurons
        elif s.function:
            padded = self.padded_neurons != self.neurons
            queries = self.padded_neurons if s.rope or padded else 0
            if s.decay and s.resets:  # `decayed_resets`' score factor, a [B, H, K, C, C] kept
                scores *= 2
        else:
            if chunks == 1:
                copies = 2 if s.autocast else 1
            else:
                copies = 3 if s.autocast else 1 + 2 * s.decay
            queries = copies * self.padded_neurons
            scores *= 3 if s.autocast and chunks > 1 else 1 + s.decay
            values = self.padded_values + self.stream
        return queries + values + scores + self._chunk_states() + stats

    def outside_mixer_kept(self) -> int:
        """What the rest of the layer keeps: x, relu(pre), the gate's output (and dropout's
        mask), the mixer's normalised output, and the residual stream's three tensors."""
        s = self.shape
        mask = 0
        if s.dropout:  # the CPU keeps dropout's scaled noise, CUDA a mask of bools
            mask = self.neurons if s.device_type == "cpu" else self.neurons // s.element
        return 3 * self.neurons + mask + self.values + 3 * self.stream

    def layer_kept(self) -> int:
        return self.mixer_kept() + self.outside_mixer_kept()

    def _mixer_workspace(self) -> int:
        """The most the mixer's backward allocates at once (ChunkedAttention.backward): the
        score gradients (all T x T, also in panels), dQ, dV per head, and for chunks the
        state gradients; autograd's products take about as much."""
        s = self.shape
        name = self._executor()[0]
        if name == "recurrent":
            return 2 * self.state + self.neurons
        chunks, chunk = self._chunks()
        score_grads = s.rows * s.heads * chunks * chunk * chunk * s.element
        carried = 2 * self.state if self.reads_state else 0
        if chunks == 1:
            symmetric = 0 if self._panel_rows() else score_grads  # dA + dA^T, outside panels
            return score_grads + max(symmetric + self.padded_neurons, self.padded_values) + carried
        states = 2 * chunks * self.state
        return (
            score_grads
            + self.padded_neurons
            + max(score_grads, self.padded_values + states)
            + carried
        )

    def layer_workspace(self, recompute: str) -> int:
        """The most one layer's backward holds on top of what the other layers keep: the
        gate's gradients while its inputs are still kept, or the mixer's backward once the
        gate's tensors are freed (its own kept tensors first recomputed under 'mixer' and
        'layer')."""
        gate = 2 * self.neurons
        mixer = self._mixer_workspace() - self.neurons - self.values
        if recompute == "mixer":
            mixer += self.mixer_kept()
        workspace = max(gate, mixer)
        if recompute == "layer":
            workspace += self.layer_kept()
        return workspace

    # ------------------------------------------------------------------ per piece
    def positions_kept(self, recompute: str) -> int:
        """rope's terms: the unit turns autograd keeps (cos and sin for bfloat16 queries,
        which rope rotates without them), or, where a checkpoint re-runs the layer or its
        mixer, all four (cos, sin, the turns and their conjugates) it holds."""
        s = self.shape
        if not s.rope:
            return 0
        per_table = s.rows * self.length * s.neurons * FLOAT32  # [B, 1, T, N]
        if recompute != "none":
            return 4 * per_table
        return 2 * per_table if s.autocast else per_table

    def head_kept(self) -> int:
        """The embedding's norm and the first layer's input, the head's input and its
        float32 log-probabilities."""
        s = self.shape
        return 3 * self.stream + s.rows * self.length * s.vocab * FLOAT32

    def head_workspace(self) -> int:
        """The loss's backward: the log-probabilities' gradient and the logits'."""
        s = self.shape
        return 2 * s.rows * self.length * s.vocab * FLOAT32

    def kept(self, recompute: str) -> int:
        """What autograd keeps for this piece's backward."""
        s = self.shape
        if recompute == "layer":
            layers = s.layers * self.stream
        elif recompute == "mixer":
            layers = s.layers * self.outside_mixer_kept()
        else:
            layers = s.layers * self.layer_kept()
        casts = 0
        if s.autocast:  # the bfloat16 copy of each weight a product keeps, once per piece
            casts = (3 * s.heads * s.neurons + s.vocab) * s.embd * BFLOAT16
        return layers + self.positions_kept(recompute) + self.head_kept() + casts

    def workspace(self, recompute: str) -> int:
        return max(self.layer_workspace(recompute), self.head_workspace())


def _shape(
    model: BDHConfig, training: TrainingConfig, device_type: str, rows: int, layers: int
) -> _Shape:
    autocast = training.bfloat16_autocast(device_type)
    compiled = compile_mode_for(training.compile, torch.device(device_type)) == "layer"
    learned_decay = model.position == "alibi_learned"
    decay = model.position != "rope"
    resets = training.stream_documents == "corpus"
    return _Shape(
        rows=rows,
        heads=model.n_head,
        neurons=model.n_neurons,
        embd=model.n_embd,
        vocab=_head_width(model),
        layers=layers,
        element=BFLOAT16 if autocast else FLOAT32,
        autocast=autocast,
        rope=model.position == "rope",
        dropout=model.dropout > 0,
        function=not (autocast or compiled or learned_decay),
        decay=decay,
        resets=resets,
        device_type=device_type,
        executor=model.executor,
        chunk_size=model.chunk_size,
    )


def _head_width(model: BDHConfig) -> int:
    """The head's outputs per token (the token logits, or the NCA head's)."""
    return sum(math.prod(shape[1:]) for shape in head_parameter_shapes(model).values())


def _windows(training: TrainingConfig) -> list[list[tuple[int, int]]]:
    """The backward windows of one block, as `LanguageTrainModel` cuts them: lists of
    (start, length) forward pieces, each window of another shape once (the first, whose
    first piece starts the block, then every other)."""
    block = training.block_size
    chunk = training.tbptt_chunk_size if 0 < training.tbptt_chunk_size < block else block
    pieces = [(start, min(chunk, block - start)) for start in range(0, block, chunk)]
    per = training.tbptt_backprop_chunks
    windows: dict[tuple[bool, tuple[int, ...]], list[tuple[int, int]]] = {}
    for i in range(0, len(pieces), per):
        window = pieces[i : i + per]
        windows.setdefault((i == 0, tuple(length for _, length in window)), window)
    return list(windows.values())


def activation_peak(
    model: BDHConfig, training: TrainingConfig, device_type: str, rows: int, layers: int
) -> tuple[int, str]:
    """(bytes, the executor of the largest piece) of the activations at backward's peak:
    over the backward windows, what the window keeps plus its last piece's workspace and
    the states it holds (each piece's output state, and the carried one it started from)."""
    shape = _shape(model, training, device_type, rows, layers)
    chunked = training.tbptt_chunk_size and training.tbptt_chunk_size < training.block_size
    carries = training.streaming or bool(chunked)
    recompute = training.recompute
    best, executor = 0, ""
    for window in _windows(training):
        pieces = [
            _Piece(shape, length, carries and (start > 0 or training.streaming))
            for start, length in window
        ]
        kept = sum(piece.kept(recompute) for piece in pieces)
        held = len(pieces) + pieces[0].reads_state  # each piece's output, and its input
        states = held * layers * pieces[0].state if carries else 0
        peak = kept + states + pieces[-1].workspace(recompute)
        if peak > best:
            best, executor = peak, max(pieces, key=lambda p: p.length).executor
    return best, executor


# --------------------------------------------------------------------- the whole step
def optimizer_memory(model: BDHConfig, name: str, element: int) -> tuple[int, int]:
    """(the state `name`'s optimizer keeps between steps, the temporaries its update holds at
    once) in bytes, for parameters of `element` bytes. AdamW: two moments per parameter, one
    parameter's temporary (of the largest). Muon: one buffer for each matrix it updates
    (MUON_PARAMETERS), AdamW's two moments for the rest, MUON_TEMPORARIES of its largest
    matrix (it updates one matrix at a time, and holds more than AdamW's part)."""
    count = model.parameter_count()
    if name != "muon":
        return MOMENTS * count * element, _largest_parameter(model) * element
    shapes = state_shapes(model)
    matrices = [math.prod(shapes[key]) for key in MUON_PARAMETERS]
    rest = count - sum(matrices)
    state = (MUON_BUFFERS * sum(matrices) + MOMENTS * rest) * element
    return state, MUON_TEMPORARIES * max(matrices) * element


def estimate_step_memory(
    model: BDHConfig,
    training: TrainingConfig,
    device_type: str = "cpu",
    rows: int | None = None,
    layers: int | None = None,
    optimizer: str = "adamw",
) -> StepMemory:
    """The peak of one optimizer step of a process training `rows` rows (default the whole
    training.batch_size) through `layers` layers (default all), on `device_type`, with the
    optimizer named `optimizer` ('adamw' or 'muon': optimizer.name)."""
    rows = training.batch_size if rows is None else rows
    layers = model.n_layer if layers is None else layers
    element = torch.finfo(torch.get_default_dtype()).bits // 8  # the parameters' dtype
    count = model.parameter_count()
    parameters = count * element
    grads = count * element
    sums = count * FLOAT32  # the accumulator adds in float32
    state, temporaries = optimizer_memory(model, optimizer, element)
    activations, executor = activation_peak(model, training, device_type, rows, layers)
    largest = _largest_parameter(model) * FLOAT32
    writing = 2 * sums + largest  # the accumulator's sum, its normalised copy, a temporary
    at_step = grads + max(writing, temporaries)
    at_backward = grads + (sums if training.accumulation_steps > 1 else 0)
    if at_step > at_backward + activations:
        gradients, activations, at = at_step, 0, "the optimizer step"
    else:
        gradients, at = at_backward, "backward"
    return StepMemory(
        parameters,
        gradients,
        state,
        activations,
        rows=rows,
        block_size=training.block_size,
        executor=executor,
        at=at,
        optimizer_name=optimizer,
    )


def _largest_parameter(model: BDHConfig) -> int:
    """Elements of the model's largest parameter: the embedding, an encoder (the decoder's
    size) or a head's."""
    h, d, n = model.n_head, model.n_embd, model.n_neurons
    shapes = [(model.vocab_size, d), (h, d, n), *head_parameter_shapes(model).values()]
    return max(math.prod(shape) for shape in shapes)
