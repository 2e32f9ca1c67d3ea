"""report.html: one self-contained page of an inspection's numbers (inspect.json's), its
pictures embedded as PNG data URLs. Its Content-Security-Policy (default-src 'none'; images
only from data: URLs; inline style) keeps a browser from fetching anything, so it opens from
disk with no server and no network."""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

import torch

from bdh_train.inspect.graph import GraphSummary

PAPER_ACTIVE_SHARE = 0.05
"""The paper's figure for the share of neurons active at a time (about 5 %)."""

HEADING_CHARS = 80
"""A synapse section's heading shows at most this many characters of its prompt."""

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
    "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;"
    "padding:2px 8px;text-align:right}th{background:#eee}td.t{text-align:left;"
    "font-family:monospace;white-space:pre-wrap}img{max-width:100%}mark{background:#fd6}"
)


def _png(fig) -> str:
    """An <img> of a matplotlib Figure as an embedded PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="figure" src="data:image/png;base64,{data}">'


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def sparsity_figure(numbers: dict[str, Any], token_shares: torch.Tensor) -> str:
    """Per layer: the x, y and xy activities as bars beside the paper's 5 %; per token: the
    distribution of the share of neurons with x > 0."""
    layers = numbers["sparsity"]["layers"]
    fig = _figure(10, 3.6)
    ax = fig.add_subplot(1, 2, 1)
    for offset, name in enumerate(("x", "y", "xy")):
        ax.bar(
            [row["layer"] + (offset - 1) * 0.27 for row in layers],
            [row[name] for row in layers],
            width=0.27,
            label=f"{name} active",
        )
    ax.axhline(PAPER_ACTIVE_SHARE, color="k", linestyle="--", label="paper's ~5 %")
    ax.set_xticks([row["layer"] for row in layers])
    ax.set_xlabel("layer")
    ax.set_ylabel("share of entries > 0")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    for layer, shares in enumerate(token_shares):
        ax.hist(shares.numpy(), bins=40, histtype="step", label=f"layer {layer}")
    ax.set_xlabel("share of neurons with x > 0 on a token")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def degree_figure(graphs: list[GraphSummary]) -> str:
    """Per graph kind, the degree distribution of each head's graph as P(degree >= k) on
    log-log axes, with the fitted power law's tail from its xmin."""
    kinds = sorted({g.kind for g in graphs})
    fig = _figure(5 * len(kinds), 3.8)
    for index, kind in enumerate(kinds):
        ax = fig.add_subplot(1, len(kinds), index + 1)
        for g in (g for g in graphs if g.kind == kind):
            degrees = g.degrees[g.degrees > 0].sort().values.double()
            if not degrees.numel():
                continue
            ccdf = 1 - torch.arange(degrees.numel(), dtype=torch.float64) / degrees.numel()
            (line,) = ax.loglog(degrees.numpy(), ccdf.numpy(), ".", label=f"head {g.head}")
            if g.fit is not None:
                xmin, alpha = g.fit["xmin"], g.fit["alpha"]
                top = float(degrees.max())
                share = float((degrees >= xmin).double().mean())
                ks = [xmin, top] if top > xmin else [xmin]
                ax.loglog(
                    ks,
                    [share * (k / xmin) ** (1 - alpha) for k in ks],
                    "-",
                    color=line.get_color(),
                    alpha=0.6,
                )
        ax.set_title(f"G_{kind}: degree distribution (lines: power-law fits)")
        ax.set_xlabel("degree k")
        ax.set_ylabel("P(degree >= k)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def _table(header: list[str], rows: list[list[Any]], text_columns: tuple[int, ...] = ()) -> str:
    def cell(index: int, value: Any) -> str:
        if isinstance(value, float):
            value = "-" if math.isnan(value) else f"{value:.4g}"
        css = ' class="t"' if index in text_columns else ""
        return f"<td{css}>{value if index in text_columns else html.escape(str(value))}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(cell(i, v) for i, v in enumerate(row)) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def sparsity_rows(numbers: dict[str, Any]) -> list[list[Any]]:
    """The sparsity table's rows: each layer's heads, the layer's mean, then all layers."""
    rows: list[list[Any]] = []
    names = ("x", "y", "xy", "dead", "always_on")
    for layer in numbers["sparsity"]["layers"]:
        for head in layer["heads"]:
            rows.append([layer["layer"], head["head"], *(head[n] for n in names)])
        rows.append([layer["layer"], "all", *(layer[n] for n in names)])
    overall = numbers["sparsity"]["all"]
    rows.append(["all", "all", *(overall[n] for n in names)])
    return rows


SPARSITY_HEADER = ["layer", "head", "x active", "y active", "xy active", "dead", "always on"]


def render(numbers: dict[str, Any], figures: dict[str, str], dashboard: list[list[Any]]) -> str:
    """The whole page: definitions, sparsity, graphs, neuron dashboards, synapses."""
    parts = [
        '<!DOCTYPE html><html><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        f"<title>BDH inspection</title><style>{STYLE}</style></head><body>",
        "<h1>BDH inspection</h1>",
        f"<p>checkpoint <code>{html.escape(numbers['checkpoint'])}</code>; "
        f"{numbers['tokens']} tokens of <code>{html.escape(numbers['data'])}</code>; "
        f"position {html.escape(numbers['position'])}.</p>",
        "<h2>Sparsity</h2>",
        "<p>x = relu(u @ encoder): the neurons that read and write the state; y = relu(a @ "
        "encoder_v): the gate; xy = x * y: what reaches the decoder. Each is the share of "
        "entries &gt; 0 over the tokens above. Dead: x never &gt; 0; always on: x &gt; 0 on "
        "more than half of the tokens. The paper reports about 5 % of neurons active.</p>",
        _table(SPARSITY_HEADER, sparsity_rows(numbers)),
        figures["sparsity"],
        "<h2>Neuron graphs</h2>",
        f"<p>{html.escape(numbers['graph_method'])}</p>",
        _table(
            [
                "graph",
                "head",
                "nodes",
                "edges",
                "mean degree",
                "max degree",
                "modularity",
                "communities",
                "alpha",
                "xmin",
                "KS",
                "R vs exp",
                "p",
            ],
            [_graph_row(g) for g in numbers["graphs"]],
        ),
        figures.get("degrees", ""),
        "<h2>Neurons</h2>",
        f"<p>The most selective neurons of layer {numbers['dashboard_layer']} and the "
        "tokens that fire them most (the token marked). Selectivity: the share of a neuron's "
        "x (summed over the tokens above) that its top tokens hold, over the share those "
        "tokens are of all tokens: 1 for a neuron as active on every token, tokens / top for "
        "one active on its top tokens only. Ranked among the neurons firing on at least as "
        "many tokens as the dashboards show and not always on.</p>",
        _table(
            ["head", "neuron", "selectivity", "firing rate", "x", "context"],
            dashboard,
            text_columns=(5,),
        ),
        _always_on_section(numbers),
        _synapse_section(numbers.get("synapses")),
        "</body></html>",
    ]
    return "\n".join(parts)


def _always_on_section(numbers: dict[str, Any]) -> str:
    """The always-on neurons of the dashboard layer, apart from the ranked ones."""
    always = numbers["always_on_neurons"]
    shown = always["neurons"]
    return (
        f"<h3>Always-on neurons</h3><p>{always['count']} neurons of layer "
        f"{numbers['dashboard_layer']} have x &gt; 0 on more than half of the tokens"
        + (f"; the {len(shown)} firing most often:</p>" if shown else ".</p>")
        + (
            _table(
                ["head", "neuron", "firing rate", "mean x"],
                [[n["head"], n["neuron"], n["firing_rate"], n["mean_x"]] for n in shown],
            )
            if shown
            else ""
        )
    )


def _graph_row(g: dict[str, Any]) -> list[Any]:
    fit = g["heavy_tail_fit"] or {}
    return [
        f"G_{g['kind']}",
        g["head"],
        g["nodes"],
        g["edges"],
        g["mean_degree"],
        g["max_degree"],
        g["modularity"],
        g["communities"],
        *(
            fit.get(k, float("nan"))
            for k in ("alpha", "xmin", "ks_distance", "loglik_ratio_vs_exponential", "p_value")
        ),
    ]


def _synapse_section(synapses: dict[str, Any] | None) -> str:
    if synapses is None:
        return "<h2>Synapses</h2><p>No prompts given (--prompt or --prompts).</p>"
    parts = [
        "<h2>Synapses</h2>",
        f"<p>sigma[h] = rho[h] @ encoder_v[h] of layer {synapses['layer']} after each "
        f"prompt, among {synapses['neurons_per_head']} neurons a head.</p>",
    ]
    for index, (text, strongest) in enumerate(
        zip(synapses["prompts"], synapses["strongest"], strict=True), 1
    ):
        shown = text if len(text) <= HEADING_CHARS else text[: HEADING_CHARS - 1] + "\u2026"
        parts.append(f"<h3>prompt {index}: <code>{html.escape(shown)}</code></h3>")
        parts.append(
            _table(
                ["head", "from", "to", "value"],
                [[s["head"], s["from"], s["to"], s["value"]] for s in strongest],
            )
        )
    probe = synapses.get("probe")
    if probe is not None:
        chance = probe["chance_auc_1"]
        parts.append(
            f"<h3>Concept probe</h3><p>chosen on {probe['train_texts']} texts (with, "
            f"without), judged on {probe['held_out_texts']} held out. Separation: (mean with "
            "- mean without) / the standard deviation over the training texts. Held-out ROC "
            "AUC of the value times the sign of its separation: 1 when every held-out text "
            "lies on the side the training texts put its class, 0 the reverse, 0.5 chance; a "
            f"synapse unrelated to the concept reaches 1 with probability {chance:.3g} here "
            f"(about {chance * len(probe['synapses']):.2g} of these {len(probe['synapses'])} "
            "by chance).</p>"
        )
        parts.append(
            _table(
                ["head", "from", "to", "separation", "held-out ROC AUC"],
                [
                    [s["head"], s["from"], s["to"], s["separation"], s["held_out_auc"]]
                    for s in probe["synapses"]
                ],
            )
        )
    return "\n".join(parts)
