"""BDH trained with fewer layers first, then the preset's depth, against the preset and a GPT
at equal wall-clock (`recipe.py`'s race and scoring).

BDH's layers share one set of weights, so its depth can change mid-run at no cost in
parameters: one layer reads 1.6x the tokens a second of two. A *grown* arm trains with
`--start-layers` layers until `--fractions` of its budget, then with the preset's
`model.n_layer` (its carried state dropped at the switch: the state holds one entry per
layer); the learning-rate schedule runs on over the whole budget. The preset's own arm and
the GPT with Muon (`--gpt-layers`) race beside them, one step each in turn.

    cd benchmarks && PYTHONPATH=../src ../.venv/bin/python depth_schedule.py --budget 180
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

import recipe
import torch

from bdh_train.train.allocator import configure_host_allocator


@dataclass
class GrownArm(recipe.StreamedArm):
    """A streamed BDH arm whose `model.n_layer` becomes `final_layers` once `switch_at` of
    its budget is spent."""

    switch_at: float = 0.5
    final_layers: int = 2
    switched_at_step: int = -1

    def step(self, train: torch.Tensor) -> None:
        if self.switched_at_step < 0 and self.progress() >= self.switch_at:
            assert isinstance(self.model, recipe.BDH) and self.executor is not None
            self.model.config.n_layer = self.final_layers
            self.executor.carried_state = None  # one entry per layer: a fresh state
            self.switched_at_step = self.steps
        super().step(train)


def grown_arm(
    base: recipe.Recipe, budget: float, start: int, final: int, fraction: float
) -> GrownArm:
    """The preset's streamed arm at `start` layers, made a `GrownArm` to `final` layers."""
    arm = recipe.bdh_arm(
        base, "muon", [f"model.n_layer={start}"], budget, f"L{start} to L{final} at {fraction:.0%}"
    )
    fields = {f.name: getattr(arm, f.name) for f in dataclasses.fields(arm) if f.init}
    return GrownArm(**fields, switch_at=fraction, final_layers=final)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=180, help="seconds of training per arm")
    parser.add_argument("--start-layers", type=int, default=1)
    parser.add_argument("--fractions", default="0.3,0.6", help="shares of the budget, ','")
    parser.add_argument("--gpt-layers", type=int, default=2)
    parser.add_argument("--eval-bytes", type=int, default=65536)
    args = parser.parse_args()
    torch.set_num_threads(2)
    configure_host_allocator("auto", torch.device("cpu"))
    train, held = recipe.load_bytes(recipe.DEFAULT_DATA)
    base = recipe.Recipe("tiny")
    preset = recipe.bdh_arm(base, "muon", [], args.budget, "the preset")
    final = base.config().model.n_layer
    arms: list[recipe.Arm] = [preset]
    for f in args.fractions.split(","):
        arms.append(grown_arm(base, args.budget, args.start_layers, final, float(f)))
    arms.append(recipe.gpt_arm(base, "muon", preset.params, args.budget, args.gpt_layers))
    load = os.getloadavg()[0]
    others = recipe.race(arms, train)
    for arm in arms:
        if isinstance(arm, GrownArm):
            print(f"{arm.recipe}: {final} layers from step {arm.switched_at_step}")
    scoring = argparse.Namespace(context=128, stride=0, eval_bytes=args.eval_bytes)
    recipe.report(
        f"{args.budget:.0f} s per arm: load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; others used {others:.0%} of the CPUs",
        arms,
        held,
        scoring,
    )


if __name__ == "__main__":
    main()
