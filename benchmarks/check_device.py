"""The fast paths on an accelerator against a float64 CPU reference, before any timing.

The test suite runs on the CPU only; this script checks, on --device, that what the GPU
benchmarks time computes the right thing:

* train step in float64 on the device: logits, loss and every parameter's gradient of one
  model (config (a) with vocab 256, alibi positions so the chunked executor carries a decaying
  state) under the executors dense, chunked (chunk 64, 100 and the calibrated one: T=300
  leaves a short last chunk), rows reset mid-call (a document start at token 150 of row 0)
  and recompute = 'layer', against the same weights in float64 on the CPU with the dense
  executor: tolerance 1e-8 (a wrong result is off by 1e-3 or more; this untrained model
  magnifies rounding: two float64 runs of one model on the CPU differ by ~5e-10 when only
  the memory alignment of their tensors differs);
* the same in float32 on the device (TF32 off), and the compiled layer (`compile_layers`),
  against the float64 reference: each must be as accurate as the float32 dense executor, within
  twice its error plus 1e-6 (float32 itself is ~1e-3 off in the gradients of this untrained
  model, whose near-zero attention outputs the layer norm magnifies, so two float32 paths
  cannot agree to 1e-5 here; the tiny models of the test suite do);
* generation: 200 greedy tokens of the fast decoder (on CUDA its step is a replayed CUDA
  graph) against the generic recurrent step on the device, and a batch of three prompts of
  different lengths whose rows stop at different steps (the graph is captured again for the
  smaller batch): tokens equal; and a float64 rope model's hidden states, fixed-shape (graph)
  step against the eager one, with the rope table moving on every 5 positions: 1e-8.

Error measure: ||value - reference|| / ||reference|| per tensor, the largest over tensors.
Exits 1 if any check fails.

Run: python3 benchmarks/check_device.py --device cuda      (also runs on --device cpu)
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from _common import CONFIGS

from bdh_train.model import BDH, BDHConfig
from bdh_train.model import sampling as generation
from bdh_train.model.decoders import FastDecoder

TOLERANCE = {torch.float64: 1e-8, torch.float32: 0.0}  # float32: set from the dense error
SEQ_LEN, BATCH = 300, 2


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.detach().double().cpu()
    diff = value.detach().double().cpu() - reference
    return float(diff.norm() / reference.norm().clamp_min(1e-30))


def step_outputs(
    model: BDH, idx: torch.Tensor, targets: torch.Tensor, reset_mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Logits, loss and gradients of one forward/backward."""
    model.zero_grad(set_to_none=True)
    hidden = model.forward_hidden(idx, reset_mask=reset_mask)
    logits = model.logits_from_hidden(hidden)
    loss = model.loss_from_hidden(hidden, targets)
    loss.backward()
    out = {"logits": logits, "loss": loss}
    out.update({f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    return out


def worst(outputs: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(relative_error(outputs[k], reference[k]) for k in reference)


def executor_rows(
    model: BDH, on: tuple, resets: torch.Tensor, reference: dict, reference_reset: dict
) -> list[tuple[str, float]]:
    """(name, worst error) of each executor setting against the references."""
    rows = []
    for executor, chunk in (("dense", 0), ("chunked", 64), ("chunked", 100), ("chunked", 0)):
        model.config.executor, model.config.chunk_size = executor, chunk
        label = "dense" if executor == "dense" else f"chunked/{chunk or 'calibrated'}"
        rows.append((label, worst(step_outputs(model, *on), reference)))
    model.config.executor, model.config.chunk_size = "chunked", 64
    rows.append(
        ("chunked/64, reset at token 150", worst(step_outputs(model, *on, resets), reference_reset))
    )
    model.config.executor, model.config.chunk_size = "auto", 0
    model.set_recompute("layer")
    rows.append(("auto, recompute=layer", worst(step_outputs(model, *on), reference)))
    model.set_recompute("none")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    config = BDHConfig(**CONFIGS["a"], vocab_size=256, dropout=0.0, position="alibi")
    cpu64 = BDH(config).double()
    idx = torch.randint(0, 256, (BATCH, SEQ_LEN))
    targets = torch.randint(0, 256, (BATCH, SEQ_LEN))
    resets = torch.zeros(BATCH, SEQ_LEN, dtype=torch.bool)
    resets[0, 150] = True
    on = (idx.to(device), targets.to(device))
    cpu64.config.executor = "dense"
    reference = step_outputs(cpu64, idx, targets)
    reference_reset = step_outputs(cpu64, idx, targets, resets)

    rows: list[tuple[str, torch.dtype, float]] = []
    model = BDH(copy.deepcopy(config)).double().to(device)
    model.load_state_dict(cpu64.state_dict())
    for name, error in executor_rows(model, on, resets.to(device), reference, reference_reset):
        rows.append((f"{name} vs CPU dense", torch.float64, error))

    model = BDH(copy.deepcopy(config)).to(device)
    model.load_state_dict(cpu64.state_dict())
    float32_rows = executor_rows(model, on, resets.to(device), reference, reference_reset)
    float32_dense_error = dict(float32_rows)["dense"]
    TOLERANCE[torch.float32] = 2 * float32_dense_error + 1e-6
    for name, error in float32_rows:
        rows.append((f"{name} vs CPU float64 dense", torch.float32, error))
    model.compile_layers()
    rows.append(
        ("compiled vs CPU float64 dense", torch.float32, worst(step_outputs(model, *on), reference))
    )

    model.eval()
    prompt = on[0][:1, :16]
    with torch.no_grad():
        fast = generation.generate(model, prompt, 200, temperature=0, decoder="fast")
        generic = generation.generate(model, prompt, 200, temperature=0, decoder="generic")
        prompts = [on[0][0, :5], on[0][1, :11], on[0][0, 40:43]]
        fast_rows = generation.generate_batch(model, prompts, 120, temperature=0, decoder="fast")
        stops = [int(fast_rows[0][5 + 30]), int(fast_rows[1][11 + 70])]
        batches = [
            generation.generate_batch(
                model, prompts, 120, temperature=0, stop_tokens=stops, decoder=name
            )
            for name in ("fast", "generic")
        ]
    same_tokens = bool(torch.equal(fast, generic))
    same_batches = all(torch.equal(a, b) for a, b in zip(*batches, strict=True))
    lengths = [len(row) for row in batches[0]]
    stopped_apart = len(set(lengths)) == len(lengths)  # rows left the batch at different steps
    rope_error = fixed_shape_vs_eager_rope(device)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device {device} ({name}), torch {torch.__version__}; ||value - reference|| / "
        "||reference||, the worst tensor of logits, loss and gradients"
    )
    failed = 0
    for label, dtype, error in rows:
        ok = error < TOLERANCE[dtype]
        failed += not ok
        print(
            f"  {str(dtype)[6:]:7s} {label:44s} {error:.2e} (< {TOLERANCE[dtype]:.2g}) "
            f"{'ok' if ok else 'FAIL'}"
        )
    print(
        f"  generate 200 tokens, fast vs generic decoder: tokens equal {same_tokens} "
        f"{'ok' if same_tokens else 'FAIL'}"
    )
    batch_ok = same_batches and stopped_apart
    print(
        f"  generate_batch, 3 prompts, stop tokens (rows of {lengths} tokens), fast vs "
        f"generic: equal {same_batches}, rows stopped apart {stopped_apart} "
        f"{'ok' if batch_ok else 'FAIL'}"
    )
    rope_ok = rope_error < TOLERANCE[torch.float64]
    print(
        f"  float64 rope decoding, fixed-shape (graph) vs eager step, 3 rows, the rope table "
        f"moving every 5 positions: hidden states {rope_error:.2e} "
        f"(< {TOLERANCE[torch.float64]:g}) {'ok' if rope_ok else 'FAIL'}"
    )
    return 0 if failed == 0 and same_tokens and batch_ok and rope_ok else 1


def fixed_shape_vs_eager_rope(device: torch.device) -> float:
    """The worst relative error of the fixed-shape step's hidden states (on CUDA a replayed
    graph, captured again each time the rope table moves on) against the eager step's, for
    a float64 rope model over 40 teacher-forced steps of 3 rows at different positions."""
    torch.manual_seed(1)
    model = BDH(BDHConfig(**CONFIGS["a"], vocab_size=256, dropout=0.0)).double().to(device)
    model.eval()
    tokens = torch.randint(0, 256, (3, 60), device=device)
    starts = (5, 11, 2)
    hidden: dict[bool, list[torch.Tensor]] = {}
    table_tokens = generation.ROPE_TABLE_TOKENS
    generation.ROPE_TABLE_TOKENS = 5
    try:
        with torch.inference_mode():
            for static in (False, True):
                states = []
                for row, start in enumerate(starts):
                    state = model.init_state(1)
                    model.forward_hidden(tokens[row : row + 1, :start], state)
                    states.append(state)
                decoder = FastDecoder(model, type(states[0]).concat(states), static=static)
                hidden[static] = [
                    decoder.step(torch.stack([tokens[r, s + i] for r, s in enumerate(starts)]))
                    for i in range(40)
                ]
    finally:
        generation.ROPE_TABLE_TOKENS = table_tokens
    return max(relative_error(a, b) for a, b in zip(hidden[True], hidden[False], strict=True))


if __name__ == "__main__":
    sys.exit(main())
