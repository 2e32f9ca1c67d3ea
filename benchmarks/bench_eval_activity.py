"""The cost of recording neuron activity at an evaluation (`training.eval_activity`): one
evaluation of the tiny preset (config (a): L4 D128 H4 multiplier 16, vocab 256, N = 512) on
`--batches` batches of 16 x 128 tokens, with the activity recorded and without, alternating
(without, with, without, ...) so that load from other processes falls on both; the fastest
round of each is reported with their ratio.

Run: .venv/bin/python benchmarks/bench_eval_activity.py [--batches 4 --rounds 5 --threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import CONFIGS, machine_line, print_table

from bdh_train.data.tokens import TokenData
from bdh_train.model import BDH, BDHConfig, LanguageHeadConfig
from bdh_train.train.evaluate import Evaluator
from bdh_train.train.step import LanguageTrainModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = BDH(BDHConfig(**CONFIGS["a"], vocab_size=256, dropout=0.0))
    tokens = torch.randint(0, 256, (args.batches * 16 * 129 + 1,)).numpy()
    evaluator = Evaluator(
        LanguageTrainModel(model),
        TokenData(tokens, 256, "random"),
        128,
        16,
        args.batches,
        "cpu",
        None,
        LanguageHeadConfig(),
        None,
    )
    best = {"without": float("inf"), "with": float("inf")}
    evaluator.run()  # warm-up
    for _ in range(args.rounds):
        for name in best:
            evaluator.activity_of = model if name == "with" else None
            start = time.perf_counter()
            evaluator.run()
            best[name] = min(best[name], time.perf_counter() - start)
    print(machine_line())
    extra = best["with"] - best["without"]
    print_table(
        f"one evaluation, {args.batches} batches of 16 x 128 tokens, fastest of {args.rounds}",
        ["activity", "seconds", "ratio"],
        [
            ["not recorded", f"{best['without']:.3f}", "1.00"],
            ["recorded", f"{best['with']:.3f}", f"{best['with'] / best['without']:.2f}"],
            ["cost", f"{extra:+.3f}", ""],
        ],
    )


if __name__ == "__main__":
    main()
