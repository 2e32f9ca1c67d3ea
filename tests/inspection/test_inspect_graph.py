"""The neuron graph (inspect/graph.py) and its heavy-tail fit (inspect/heavy_tail.py) against
hand computations: two planted communities with known modularity, a planted hub, the
blockwise top entries against the dense matrix, and a planted power law's exponent."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch
from helpers import tiny_model

from bdh_train.inspect.graph import (
    communities,
    graph_factors,
    hubs,
    neuron_graph,
    sample_neurons,
    summarize_graph,
    top_edges,
    undirected_graph,
    write_hub_graphml,
)
from bdh_train.inspect.heavy_tail import heavy_tail_fit


def two_communities(hub: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoder_h, encoder_h): neurons 0-3 write and read e0, 4-7 write and read e1, so
    G = decoder_h @ encoder_h is 1 inside each block of four and 0 across; with `hub`,
    neuron 8 writes 2 * (e0 + e1) and reads e2: G[8, j] = 2 for every j < 8."""
    n = 9 if hub else 8
    decoder = torch.zeros(n, 3, dtype=torch.float64)
    encoder = torch.zeros(3, n, dtype=torch.float64)
    decoder[:4, 0] = encoder[0, :4] = 1
    decoder[4:8, 1] = encoder[1, 4:8] = 1
    if hub:
        decoder[8, :2] = 2
        encoder[2, 8] = 1
    return decoder, encoder


def test_two_planted_communities_have_modularity_one_half():
    decoder, encoder = two_communities(hub=False)
    rows, cols, values = top_edges(decoder, encoder, 24)
    inside = {(i, j) for b in (range(4), range(4, 8)) for i in b for j in b if i != j}
    assert set(zip(rows.tolist(), cols.tolist(), strict=True)) == inside
    assert values.tolist() == [1.0] * 24
    graph = undirected_graph(8, rows, cols)
    parts, modularity = communities(graph)
    # m = 12 edges; each K4: 6 inside, degree sum 12 -> Q = 2 * (6/12 - (12/24)^2) = 0.5
    assert sorted(map(sorted, parts)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert modularity == pytest.approx(0.5, abs=1e-12)
    summary = summarize_graph(decoder, encoder, "x", 0, edges_per_neuron=3)
    assert summary.modularity == pytest.approx(0.5, abs=1e-12)
    assert summary.degrees.tolist() == [3] * 8 and summary.fit is None


def test_a_planted_hub_is_the_top_hub():
    decoder, encoder = two_communities(hub=True)
    rows, cols, _ = top_edges(decoder, encoder, 32)  # 8 edges of the hub + 24 inside
    graph = undirected_graph(9, rows, cols)
    assert hubs(graph, 2) == [(8, 8), (0, 4)]
    # best partition {0-3, 8}, {4-7}: m = 20; Q = 10/20 - (24/40)^2 + 6/20 - (16/40)^2
    _, modularity = communities(graph)
    assert modularity == pytest.approx(0.28, abs=1e-12)


def test_blockwise_top_edges_equal_the_dense_matrix_top_entries():
    generator = torch.Generator().manual_seed(0)
    decoder, encoder = (
        torch.randn(50, 6, generator=generator),
        torch.randn(6, 50, generator=generator),
    )
    rows, cols, values = top_edges(decoder, encoder, 120, block_rows=7)
    dense = decoder @ encoder
    magnitude = dense.abs().fill_diagonal_(-1).reshape(-1)
    expected = magnitude.topk(120).indices
    assert set((rows * 50 + cols).tolist()) == set(expected.tolist())
    torch.testing.assert_close(values, dense[rows, cols], rtol=0, atol=1e-5)


def test_graph_factors_are_the_decoder_rows_and_encoder_of_the_head():
    model = tiny_model()  # H = 2, N = 4 * 16 / 2 = 32
    n = model.config.n_neurons
    for kind, encoder in (("x", model.encoder), ("y", model.encoder_v)):
        expected = model.decoder[n : 2 * n] @ encoder[1]
        torch.testing.assert_close(neuron_graph(model, kind, 1), expected, rtol=0, atol=0)
        decoder_h, _ = graph_factors(model, kind, 1)
        assert decoder_h.shape == (n, model.config.n_embd)


def test_a_sample_of_neurons_is_seeded_sorted_and_distinct():
    assert sample_neurons(8, 8).tolist() == list(range(8))
    sample = sample_neurons(1000, 50, seed=3)
    assert sample.tolist() == sorted(set(sample.tolist())) and len(sample) == 50
    assert torch.equal(sample, sample_neurons(1000, 50, seed=3))
    assert not torch.equal(sample, sample_neurons(1000, 50, seed=4))


def test_hub_subgraph_graphml_holds_the_hubs_and_their_edges(tmp_path):
    decoder, encoder = two_communities(hub=True)
    summary = summarize_graph(decoder, encoder, "y", 1, edges_per_neuron=4, hub_count=3)
    path = tmp_path / "hubs.graphml"
    write_hub_graphml(summary, path, hub_count=3)
    graph = nx.read_graphml(path, node_type=int)
    assert 8 in graph.nodes and graph.number_of_nodes() == 3
    assert graph.nodes[8]["degree"] == 8 and graph.nodes[8]["head"] == 1


def test_planted_power_law_exponent_is_recovered_and_beats_an_exponential():
    rng = np.random.default_rng(0)
    alpha, xmin = 2.5, 4
    u = rng.random(100_000)
    # discrete power law by the continuous approximation of Clauset et al. (2009), eq. D.6
    planted = np.floor((xmin - 0.5) * (1 - u) ** (-1 / (alpha - 1)) + 0.5)
    fit = heavy_tail_fit(planted)
    assert abs(fit["alpha"] - alpha) < 0.1
    assert fit["loglik_ratio_vs_exponential"] > 0 and fit["p_value"] < 1e-3
    geometric = rng.geometric(0.2, 20_000)
    assert heavy_tail_fit(geometric)["loglik_ratio_vs_exponential"] < 0


def test_hubs_of_a_sampled_graph_are_named_by_neuron_id(tmp_path):
    """40 neurons, 20 sampled: the planted hub is named by its neuron id, not its node index
    in the sample, in the hubs, the numbers and the GraphML. Neurons write and read e0 or
    e1 alternately; the hub writes 2 * (e0 + e1) and reads e2, so G[hub, j] = 2 for every
    other neuron j: its degree is the 19 other sampled neurons."""
    sample = sample_neurons(40, 20, seed=0).tolist()
    hub = sample[10]
    assert hub != 10  # a node index read as a neuron id would differ
    decoder = torch.zeros(40, 3, dtype=torch.float64)
    encoder = torch.zeros(3, 40, dtype=torch.float64)
    for neuron in range(40):
        decoder[neuron, neuron % 2] = encoder[neuron % 2, neuron] = 1
    decoder[hub] = torch.tensor([2.0, 2.0, 0.0])
    encoder[:, hub] = torch.tensor([0.0, 0.0, 1.0])
    summary = summarize_graph(decoder, encoder, "x", 0, edges_per_neuron=10, max_neurons=20)
    assert summary.neurons.tolist() == sample
    assert summary.hubs[0] == (hub, 19)
    assert summary.numbers()["hubs"][0] == {"neuron": hub, "degree": 19}
    write_hub_graphml(summary, tmp_path / "hubs.graphml", hub_count=1)
    assert list(nx.read_graphml(tmp_path / "hubs.graphml", node_type=int).nodes) == [hub]
