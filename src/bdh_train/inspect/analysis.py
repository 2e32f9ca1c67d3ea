"""`bdh-train inspect`: a run's neurons, neuron graphs and synapses, as numbers
(`inspect_model`, for notebooks) and as a report directory (`inspect_checkpoint`:
report.html, inspect.json and one GraphML file of hubs per graph), written whole or not at all.
"""

from __future__ import annotations

import html
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bdh_train.data.tokenizer import Tokenizer
from bdh_train.errors import BDHTrainError, DataError
from bdh_train.inspect.graph import (
    GRAPH_KINDS,
    GraphSummary,
    graph_factors,
    summarize_graph,
    write_hub_graphml,
)
from bdh_train.inspect.neuron_activity import InspectRecorder, record_activity
from bdh_train.inspect.report import degree_figure, render, sparsity_figure
from bdh_train.inspect.synapses import check_probe_classes, synapse_report
from bdh_train.model.bdh import BDH
from bdh_train.storage.output import check_output, publish_dir

REPORT_FILE = "report.html"
NUMBERS_FILE = "inspect.json"
CONCEPT_KEY = "concept"
"""A prompts-file line's key marking a text with (true) or without (false) the concept."""

GRAPH_METHOD = (
    "G_x[h] = decoder_h @ encoder[h], G_y[h] = decoder_h @ encoder_v[h]; the graph keeps the "
    "{edges} largest |entries| (i != j) among {nodes} neurons{sampled} as undirected "
    "unweighted edges; communities: Louvain (networkx, seed 0); heavy-tail fit: discrete "
    "power law by maximum likelihood, xmin by Kolmogorov-Smirnov, R = log-likelihood ratio "
    "against an exponential (R > 0 favours the power law; p its significance)."
)


@dataclass
class InspectOptions:
    """What an inspection reads and how much."""

    max_tokens: int = 8192
    """Tokens of data read for the activity and the neuron dashboards."""
    block_size: int = 256
    """Tokens a row; each row starts from a fresh state."""
    batch_size: int = 8
    """Rows a forward call."""
    graph_neurons: int = 8192
    """Neurons a graph is built over; a head with more is sampled uniformly (seeded)."""
    edges_per_neuron: int = 8
    """The thresholded graph keeps this many entries per neuron (the largest |G_ij|)."""
    hubs: int = 20
    """Hubs listed per graph and nodes of the GraphML hub subgraph."""
    dashboard_neurons: int = 12
    """Neurons shown in the dashboards (the most selective: `neuron_selectivity`)."""
    top_k: int = 4
    """Contexts shown per dashboard neuron."""
    context: int = 24
    """Tokens of context either side of a dashboard token."""
    probe_neurons: int = 64
    """Neurons a head whose synapses the synapse section reads."""
    layer: int = -1
    """The layer of the dashboards and the synapses (-1: the last)."""
    seed: int = 0


@dataclass
class Inspection:
    """What `inspect_model` found: the JSON numbers and what the report draws from."""

    numbers: dict[str, Any]
    recorder: InspectRecorder
    graphs: list[GraphSummary]
    dashboard: list[list[Any]] = field(default_factory=list)


def check_options(options: InspectOptions) -> None:
    """Refuse sizes below 1 before anything is read."""
    for name in (
        "max_tokens",
        "block_size",
        "batch_size",
        "graph_neurons",
        "edges_per_neuron",
        "hubs",
        "dashboard_neurons",
        "top_k",
        "probe_neurons",
    ):
        value = getattr(options, name)
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise BDHTrainError(f"{flag} must be >= 1, got {value}")


def layer_of(options: InspectOptions, n_layer: int) -> int:
    """The layer `options.layer` names (negative counts from the last); a layer the model
    does not have is refused."""
    if not -n_layer <= options.layer < n_layer:
        raise BDHTrainError(
            f"--layer {options.layer} is not a layer of this model: it has {n_layer} "
            f"(0 to {n_layer - 1}, or -1 to -{n_layer} counting from the last)"
        )
    return options.layer % n_layer


def sparsity_numbers(recorder: InspectRecorder) -> dict[str, Any]:
    """Per layer and head: x, y, xy activity, dead and always-on shares; layer means; all."""
    tables = recorder.tables()
    layers = []
    for layer in range(recorder.tokens.numel()):
        heads = [
            {"head": h, **{k: float(t[layer, h]) for k, t in tables.items()}}
            for h in range(recorder.fires.shape[1])
        ]
        layers.append(
            {
                "layer": layer,
                **{k: float(t[layer].mean()) for k, t in tables.items()},
                "heads": heads,
            }
        )
    shares = recorder.token_shares()
    quantiles = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    return {
        "layers": layers,
        "all": {k: float(t.mean()) for k, t in tables.items()},
        "token_x_share_quantiles": [
            dict(zip(("p10", "p50", "p90"), s.quantile(quantiles).tolist(), strict=True))
            for s in shares
        ],
    }


def _context(tokenizer: Tokenizer | None, tokens: torch.Tensor, at: int, width: int) -> str:
    """HTML of the tokens around position `at`, that token marked."""

    def text(ids: torch.Tensor) -> str:
        values = ids.tolist()
        if tokenizer is None:
            return " ".join(str(v) for v in values) + " "
        return tokenizer.decode(values)

    before = text(tokens[max(0, at - width) : at])
    after = text(tokens[at + 1 : at + 1 + width])
    return (
        html.escape(before)
        + "<mark>"
        + html.escape(text(tokens[at : at + 1]))
        + "</mark>"
        + html.escape(after)
    )


def neuron_selectivity(recorder: InspectRecorder) -> tuple[torch.Tensor, torch.Tensor]:
    """([H, N] selectivity, [H, N] top share) of the dashboard layer's neurons. A neuron's top
    share is the part of its x, summed over every token, that its K largest x hold (K = the
    recorder's top_k, at most the tokens); its base rate is K / tokens, the share any K
    tokens hold when x is the same on every token. Selectivity = top share / base rate: 1
    for a neuron as active everywhere, tokens / K for one active on K tokens only."""
    tokens = max(int(recorder.tokens[recorder.dashboard_layer]), 1)
    top = recorder.top_values.double().clamp(min=0).sum(1).cpu()  # [H, N]
    total = recorder.x_sum.cpu()
    share = torch.where(total > 0, top / total.clamp(min=1e-300), torch.zeros_like(total))
    base_rate = recorder.top_values.shape[1] / tokens
    return share / base_rate, share


def dashboard(
    recorder: InspectRecorder,
    tokens: torch.Tensor,
    tokenizer: Tokenizer | None,
    options: InspectOptions,
) -> tuple[list[dict[str, Any]], list[list[Any]], dict[str, Any]]:
    """(JSON, table rows) of the most selective neurons of the dashboard layer
    (`neuron_selectivity`; among those firing on at least K tokens and not always on, ties
    broken by the larger summed x), and the JSON of its always-on neurons (x > 0 on more than
    half the tokens): their count and the most often firing of them."""
    layer = recorder.dashboard_layer
    fires = recorder.fires[layer].cpu()  # [H, N]
    total = max(int(recorder.tokens[layer]), 1)
    n = fires.shape[1]
    selectivity, share = neuron_selectivity(recorder)
    always_on = recorder.always_on_neurons()[layer].cpu()
    kept = recorder.top_values.shape[1]
    candidates = (~always_on & (fires >= max(kept, 1))).reshape(-1)
    flat_sel = selectivity.reshape(-1)
    by_sum = recorder.x_sum.cpu().reshape(-1).argsort(descending=True, stable=True)
    by_sel = flat_sel[by_sum].argsort(descending=True, stable=True)
    ranked = by_sum[by_sel]
    order = ranked[candidates[ranked]][: options.dashboard_neurons].tolist()
    numbers, rows = [], []
    for flat in order:
        head, neuron = divmod(flat, n)
        values = recorder.top_values[head, :, neuron].cpu().tolist()
        where = recorder.top_tokens[head, :, neuron].cpu().tolist()
        rate = int(fires[head, neuron]) / total
        top = []
        for value, at in zip(values, where, strict=True):
            if value <= 0:
                continue
            context = _context(tokenizer, tokens, at, options.context)
            top.append({"activation": value, "token": at})
            rows.append([head, neuron, float(flat_sel[flat]), rate, value, context])
        numbers.append(
            {
                "layer": layer,
                "head": head,
                "neuron": neuron,
                "selectivity": float(flat_sel[flat]),
                "top_share": float(share.reshape(-1)[flat]),
                "firing_rate": rate,
                "top": top,
            }
        )
    on = always_on.reshape(-1).nonzero().flatten()
    on = on[fires.reshape(-1)[on].argsort(descending=True, stable=True)]
    shown = [
        {
            "layer": layer,
            "head": int(flat) // n,
            "neuron": int(flat) % n,
            "firing_rate": int(fires.reshape(-1)[flat]) / total,
            "mean_x": float(recorder.x_sum.reshape(-1)[flat]) / total,
        }
        for flat in on[: options.dashboard_neurons].tolist()
    ]
    return numbers, rows, {"count": int(on.numel()), "neurons": shown}


def inspect_model(
    model: BDH,
    tokens: torch.Tensor,
    tokenizer: Tokenizer | None,
    options: InspectOptions,
    prompts: list[list[int]] | None = None,
    labels: list[bool] | None = None,
    progress: Any = None,
) -> Inspection:
    """Record the model's neurons over `tokens` [T] (the first `max_tokens`), build and fit
    every head's G_x and G_y, and read the synapses after each prompt (the concept probe with
    `labels`). `progress(tokens)` is called as the data is read."""
    check_options(options)
    c = model.config
    layer = layer_of(options, c.n_layer)
    tokens = tokens[: options.max_tokens].to(torch.int64)
    if tokens.numel() == 0:
        raise DataError("no tokens to inspect: give --data a source with at least one token")
    recorder = InspectRecorder(
        c.n_layer, c.n_head, c.n_neurons, layer, options.top_k, model.embed.weight.device
    )
    record_activity(model, tokens, options.block_size, options.batch_size, recorder, progress)
    graphs = [
        summarize_graph(
            *graph_factors(model, kind, head),
            kind,
            head,
            options.edges_per_neuron,
            options.graph_neurons,
            options.hubs,
            options.seed,
        )
        for kind in GRAPH_KINDS
        for head in range(c.n_head)
    ]
    nodes = min(c.n_neurons, options.graph_neurons)
    sampled = (
        f" (a uniform sample of the head's {c.n_neurons}, seed {options.seed})"
        if nodes < c.n_neurons
        else ""
    )
    neuron_numbers, rows, always_on = dashboard(recorder, tokens, tokenizer, options)
    numbers: dict[str, Any] = {
        "tokens": int(tokens.numel()),
        "position": c.position,
        "sparsity": sparsity_numbers(recorder),
        "graph_method": GRAPH_METHOD.format(
            edges=options.edges_per_neuron * nodes, nodes=nodes, sampled=sampled
        ),
        "graphs": [g.numbers() for g in graphs],
        "dashboard_layer": layer,
        "neurons": neuron_numbers,
        "always_on_neurons": always_on,
        "synapses": None,
    }
    if prompts:
        texts = None if tokenizer is None else [tokenizer.decode(ids) for ids in prompts]
        numbers["synapses"] = synapse_report(
            model, prompts, labels, layer, options.probe_neurons, options.hubs, texts
        )
        numbers["synapses"]["position"] = c.position
    return Inspection(numbers, recorder, graphs, rows)


def check_report_dir(path: Path) -> None:
    """Refuse an existing directory that is not an earlier report: one holding anything but
    the files `write_report` writes (a run, a user's folder) is never replaced."""
    foreign = sorted(
        entry.name
        for entry in path.iterdir()
        if entry.is_symlink()
        or not entry.is_file()
        or not (entry.name in (REPORT_FILE, NUMBERS_FILE) or _HUBS.fullmatch(entry.name))
    )
    if foreign or not (path / NUMBERS_FILE).is_file():
        why = f"it holds {', '.join(foreign[:3])}" if foreign else f"it has no {NUMBERS_FILE}"
        raise BDHTrainError(
            f"--out {path} is not an earlier inspect report ({why}); --force replaces only "
            "a report: name a new directory"
        )


_HUBS = re.compile(r"hubs_G[xy]_head\d+\.graphml")
"""The name of a hub subgraph's GraphML file."""


def check_report_out(out: str | os.PathLike[str], force: bool = False) -> Path:
    """--out under the output policy (storage.output): a new directory, or with `force` an
    earlier report; never a run, a checkpoint or a place inside one."""
    return check_output(out, "--out", force=force, directory=True, same_kind=check_report_dir)


def write_report(inspection: Inspection, out: Path, hubs: int, force: bool = False) -> Path:
    """Write report.html, inspect.json and the hub GraphML files as the directory `out`,
    published whole (`storage.output.publish_dir`: built beside it, renamed into place). An
    existing `out` is refused (`check_report_out`), unless `force` and it is an earlier
    report, which is replaced."""

    def write(building: Path) -> None:
        numbers = inspection.numbers
        figures = {"sparsity": sparsity_figure(numbers, inspection.recorder.token_shares())}
        if inspection.graphs:
            figures["degrees"] = degree_figure(inspection.graphs)
        for g in inspection.graphs:
            write_hub_graphml(g, building / f"hubs_G{g.kind}_head{g.head}.graphml", hubs)
        (building / NUMBERS_FILE).write_text(json.dumps(numbers, indent=1) + "\n")
        (building / REPORT_FILE).write_text(render(numbers, figures, inspection.dashboard))

    final = publish_dir(out, write, "--out", "inspect", force=force, same_kind=check_report_dir)
    return final / REPORT_FILE


def read_probe_prompts(
    prompt: str | None, prompts_file: str | None, tokenizer: Tokenizer
) -> tuple[list[list[int]], list[bool] | None]:
    """(token ids of each prompt, concept labels or None): `prompt`, or the JSON lines of
    `prompts_file` ({"prompt": TEXT, "concept": true|false}; "concept" on every line or on
    none)."""
    from bdh_train.generation.completions import read_prompts
    from bdh_train.shared.loading import encode_text

    if prompt is not None:
        ids = encode_text(tokenizer, prompt, "--prompt")
        if not ids:
            raise DataError("--prompt is 0 tokens in this run's tokenizer: give a longer text")
        return [ids], None
    if prompts_file is None:
        return [], None
    records = list(read_prompts(prompts_file, tokenizer))
    marked = [CONCEPT_KEY in r.fields for r in records]
    if any(marked) and not all(marked):
        line = marked.index(False) + 1
        raise DataError(
            f'{prompts_file}: prompt {line} has no "{CONCEPT_KEY}" key but others have: mark '
            "every prompt true or false, or none"
        )
    if not any(marked):
        return [r.ids for r in records], None
    labels = []
    for number, record in enumerate(records, 1):
        value = record.fields[CONCEPT_KEY]
        if not isinstance(value, bool):
            raise DataError(
                f'{prompts_file}: prompt {number}: "{CONCEPT_KEY}" is {json.dumps(value)}, '
                "not true or false"
            )
        labels.append(value)
    check_probe_classes(labels)
    return [r.ids for r in records], labels


def inspect_checkpoint(
    checkpoint: str,
    out: str,
    options: InspectOptions,
    data: str | None = None,
    prompt: str | None = None,
    prompts_file: str | None = None,
    device: str = "cpu",
    force: bool = False,
) -> Path:
    """Inspect a run (directory, checkpoint or export) on `data` and the prompts, and write
    the report directory `out` (`write_report`); return its report.html. The data is what
    eval reads (`DataConfig.evaluation_data`): `data`, else the run's validation split.
    Every input is checked before anything is computed or written."""
    from bdh_train.shared.loading import load_run

    check_options(options)
    check_report_out(out, force)
    model, tokenizer, cfg = load_run(checkpoint, device=device)
    layer_of(options, model.config.n_layer)
    if tokenizer is None and (data is None or prompt is not None or prompts_file is not None):
        raise DataError(
            f"{checkpoint} carries no text tokenizer, so its data and prompts cannot be read "
            "as text: pass --data a .bin file of its token ids, and no prompts"
        )
    prompts, labels = (
        read_probe_prompts(prompt, prompts_file, tokenizer) if tokenizer else ([], None)
    )
    stream = cfg.data.evaluation_data(data, model.config.vocab_size, None, tokenizer)
    tokens = torch.from_numpy(stream.tokens[: options.max_tokens].astype("int64"))
    inspection = inspect_model(
        model, tokens, tokenizer, options, prompts, labels, progress=_bar(len(tokens))
    )
    inspection.numbers = {
        "checkpoint": str(checkpoint),
        "data": stream.source,
        **inspection.numbers,
    }
    return write_report(inspection, Path(out), options.hubs, force)


def _bar(total: int):
    """A tqdm bar of tokens read on stderr (shown on a terminal only); its update method."""
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", desc="inspect", disable=None, leave=False).update
