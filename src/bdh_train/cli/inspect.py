"""`bdh-train inspect`: a run's sparsity, neuron graphs, neurons and synapses as one
self-contained report.html (and the numbers as inspect.json)."""

from __future__ import annotations

import argparse

from bdh_train.cli.args import _add_inference_args, _check_inference_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="look inside a run: sparsity, neuron graphs, neuron dashboards and synapses, "
        "written to OUT/report.html (opens from disk) and OUT/inspect.json",
    )
    _add_inference_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="the report directory")
    p.add_argument(
        "--force", action="store_true", help="replace an earlier report at --out (only a report)"
    )
    p.add_argument(
        "--data", default=None, help="data to read (default: the run's validation split)"
    )
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default=None, help="a text whose synapses are shown")
    prompts.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help='JSON lines {"prompt": TEXT, "concept": true|false}: the synapses of each, and '
        'with "concept" the concept probe (held-out ROC AUC; 4 or more prompts of each class)',
    )
    p.add_argument(
        "--max-tokens", type=int, default=8192, help="tokens of data read (bounds the work)"
    )
    p.add_argument(
        "--graph-neurons",
        type=int,
        default=8192,
        help="neurons a head's graph is built over; more are sampled uniformly",
    )
    p.add_argument(
        "--layer", type=int, default=-1, help="layer of the dashboards and synapses (-1: last)"
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    _check_inference_args(args)
    from bdh_train.inspect.analysis import InspectOptions, check_options, inspect_checkpoint
    from bdh_train.shared.threads import set_threads

    options = InspectOptions(
        max_tokens=args.max_tokens, graph_neurons=args.graph_neurons, layer=args.layer
    )
    check_options(options)
    set_threads(args.threads)
    report = inspect_checkpoint(
        args.checkpoint,
        args.out,
        options,
        args.data,
        args.prompt,
        args.prompts,
        args.device,
        force=args.force,
    )
    print(report)
    return 0
