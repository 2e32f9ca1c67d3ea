"""The neuron graphs: G_x[h] = decoder_h @ encoder[h] and G_y[h] = decoder_h @ encoder_v[h].

decoder_h is rows h*N .. h*N+N-1 of `decoder` [H*N, D]; entry (i, j) of G [N, N] is how
strongly neuron i's output, written into the residual stream, drives neuron j's input at the
next layer (the norm between them ignored).

The thresholded graph keeps the `edges_per_neuron * M` entries of largest |G_ij| (i != j)
among M neurons, as undirected unweighted edges (i -> j and j -> i are one edge), so the mean
degree is about 2 * edges_per_neuron whatever N is. M is every neuron when N <=
`max_neurons`, else a uniform random sample of `max_neurons` of them (seeded) and the graph
is the one they induce: a sample keeps the shape of a degree distribution's tail and scales
degrees by M / N. G is never held whole: rows are computed `block_rows` at a time
([block_rows, M] each) and only the running top entries are kept, so the cost is
M^2 * D multiply-adds and O(block_rows * M + edges) memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bdh_train.errors import BDHTrainError
from bdh_train.inspect.heavy_tail import heavy_tail_fit
from bdh_train.model.bdh import BDH

GRAPH_KINDS = ("x", "y")
"""G_x reads through `encoder`, G_y through `encoder_v`."""


def graph_factors(model: BDH, kind: str, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoder_h [N, D], encoder_h [D, N]) whose product is G_kind[head]."""
    if kind not in GRAPH_KINDS:
        raise ValueError(f"unknown neuron graph {kind!r}; expected one of {GRAPH_KINDS}")
    n = model.config.n_neurons
    encoder = model.encoder if kind == "x" else model.encoder_v
    return model.decoder[head * n : (head + 1) * n].detach(), encoder[head].detach()


def neuron_graph(model: BDH, kind: str, head: int) -> torch.Tensor:
    """The whole G_kind[head] [N, N] (for small N; `top_edges` never builds it)."""
    decoder_h, encoder_h = graph_factors(model, kind, head)
    return decoder_h @ encoder_h


def sample_neurons(n: int, max_neurons: int, seed: int = 0) -> torch.Tensor:
    """Every neuron id when n <= max_neurons, else `max_neurons` ids drawn uniformly without
    replacement (sorted), from `seed`."""
    if n <= max_neurons:
        return torch.arange(n)
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=generator)[:max_neurons].sort().values


def top_edges(
    decoder_h: torch.Tensor,
    encoder_h: torch.Tensor,
    edges: int,
    block_rows: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, cols, values) of the `edges` off-diagonal entries of decoder_h @ encoder_h
    [M, M] of largest magnitude (ties broken by torch.topk), computed `block_rows` rows at a
    time."""
    m = decoder_h.shape[0]
    edges = min(edges, m * (m - 1))
    best_abs = decoder_h.new_empty(0)
    best_index = torch.empty(0, dtype=torch.int64)
    for start in range(0, m, block_rows):
        block = (decoder_h[start : start + block_rows] @ encoder_h).float()
        rows = torch.arange(start, start + block.shape[0])
        magnitude = block.abs()
        magnitude[rows - start, rows] = -1.0  # no self-loops
        flat = magnitude.reshape(-1)
        keep = min(edges, flat.numel())
        values, index = flat.topk(keep)
        best_abs = torch.cat([best_abs.float(), values])
        best_index = torch.cat([best_index, index.cpu() + start * m])
        if best_abs.numel() > edges:
            best_abs, chosen = best_abs.topk(edges)
            best_index = best_index[chosen.cpu()]
    rows, cols = best_index // m, best_index % m
    values = (decoder_h[rows] * encoder_h[:, cols].T).sum(-1)
    return rows, cols, values.float().cpu()


def undirected_graph(m: int, rows: torch.Tensor, cols: torch.Tensor):
    """A networkx Graph of nodes 0..m-1 with one unweighted edge per kept pair."""
    import networkx as nx

    graph = nx.Graph()
    graph.add_nodes_from(range(m))
    graph.add_edges_from(zip(rows.tolist(), cols.tolist(), strict=True))
    return graph


def communities(graph) -> tuple[list[set[int]], float]:
    """(communities, modularity) of `graph`: networkx's Louvain partition (seed 0) and its
    modularity Q = sum over communities c of L_c / m - (d_c / 2m)^2 (unweighted)."""
    import networkx as nx

    if graph.number_of_edges() == 0:
        return [{node} for node in graph.nodes], 0.0
    parts = nx.community.louvain_communities(graph, seed=0)
    return parts, float(nx.community.modularity(graph, parts))


def hubs(graph, count: int) -> list[tuple[int, int]]:
    """The `count` nodes of highest degree, as (node, degree), highest first (ties: lower id
    first)."""
    ranked = sorted(graph.degree, key=lambda item: (-item[1], item[0]))
    return [(int(node), int(degree)) for node, degree in ranked[:count]]


@dataclass
class GraphSummary:
    """The thresholded neuron graph of one kind and head and its statistics."""

    kind: str
    head: int
    neurons: torch.Tensor
    """[M] neuron ids of the graph's nodes (node k is neuron neurons[k])."""
    rows: torch.Tensor
    cols: torch.Tensor
    values: torch.Tensor
    """The kept entries G[neurons[rows], neurons[cols]]."""
    degrees: torch.Tensor
    """[M] degree of each node in the undirected graph."""
    modularity: float
    community_count: int
    community_of: torch.Tensor
    """[M] community index of each node."""
    hubs: list[tuple[int, int]]
    """(neuron id, degree) of the highest-degree nodes."""
    fit: dict[str, float] | None
    """`heavy_tail_fit` of the nonzero degrees, None when too few."""

    def numbers(self) -> dict[str, Any]:
        """The JSON numbers of the report."""
        return {
            "kind": self.kind,
            "head": self.head,
            "nodes": int(self.neurons.numel()),
            "edges": int(self.rows.numel()),
            "mean_degree": float(self.degrees.double().mean()) if self.degrees.numel() else 0.0,
            "max_degree": int(self.degrees.max()) if self.degrees.numel() else 0,
            "modularity": self.modularity,
            "communities": self.community_count,
            "hubs": [{"neuron": n, "degree": d} for n, d in self.hubs],
            "heavy_tail_fit": self.fit,
        }


def summarize_graph(
    decoder_h: torch.Tensor,
    encoder_h: torch.Tensor,
    kind: str,
    head: int,
    edges_per_neuron: int = 8,
    max_neurons: int = 8192,
    hub_count: int = 20,
    seed: int = 0,
) -> GraphSummary:
    """The thresholded graph of decoder_h @ encoder_h over its (sampled) neurons: degrees,
    Louvain communities and modularity, hubs and the heavy-tail fit of the degrees."""
    neurons = sample_neurons(decoder_h.shape[0], max_neurons, seed)
    dec, enc = decoder_h[neurons.to(decoder_h.device)], encoder_h[:, neurons.to(encoder_h.device)]
    m = neurons.numel()
    rows, cols, values = top_edges(dec, enc, edges_per_neuron * m)
    graph = undirected_graph(m, rows, cols)
    degrees = torch.tensor([graph.degree[k] for k in range(m)], dtype=torch.int64)
    parts, modularity = communities(graph)
    community_of = torch.empty(m, dtype=torch.int64)
    for index, part in enumerate(parts):
        community_of[list(part)] = index
    top = [(int(neurons[node]), degree) for node, degree in hubs(graph, hub_count)]
    positive = degrees[degrees > 0].numpy()
    fit = heavy_tail_fit(positive) if len(set(positive.tolist())) >= 3 else None
    return GraphSummary(
        kind,
        head,
        neurons,
        rows,
        cols,
        values,
        degrees,
        modularity,
        len(parts),
        community_of,
        top,
        fit,
    )


def write_hub_graphml(summary: GraphSummary, path: Path, hub_count: int) -> None:
    """The subgraph induced by the `hub_count` highest-degree nodes as GraphML (nodes:
    neuron id, head, degree, community; edges: the signed entry of G as `weight`)."""
    import networkx as nx

    ranked = summary.degrees.argsort(descending=True, stable=True)[:hub_count].tolist()
    chosen = set(ranked)
    graph = nx.Graph(name=f"G_{summary.kind} head {summary.head}")
    for node in ranked:
        graph.add_node(
            int(summary.neurons[node]),
            head=summary.head,
            degree=int(summary.degrees[node]),
            community=int(summary.community_of[node]),
        )
    for r, c, v in zip(
        summary.rows.tolist(), summary.cols.tolist(), summary.values.tolist(), strict=True
    ):
        if r in chosen and c in chosen:
            graph.add_edge(int(summary.neurons[r]), int(summary.neurons[c]), weight=float(v))
    try:
        nx.write_graphml(graph, str(path))
    except OSError as exc:
        raise BDHTrainError(f"cannot write {path}: {exc.strerror or exc}") from exc
