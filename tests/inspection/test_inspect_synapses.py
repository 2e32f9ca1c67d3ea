"""Synapses and the concept probe (inspect/synapses.py) against hand computations: sigma =
rho @ encoder_v on chosen numbers, the state a prompt leaves, ROC AUC on hand-ranked scores,
and a planted synapse the probe finds with held-out AUC 1 while a random one scores ~0.5."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from bdh_train.errors import BDHTrainError
from bdh_train.inspect.synapses import (
    concept_probe,
    read_state,
    roc_auc,
    strongest,
    synapse_report,
    synapses,
)


def test_synapses_are_the_state_composed_with_encoder_v():
    rho = torch.tensor([[[1.0, 2.0], [0.0, -1.0], [3.0, 0.5]]])  # H = 1, N = 3, D = 2
    encoder_v = torch.tensor([[[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]]])  # [1, D, N]
    # sigma = rho @ encoder_v = [[1, 2, 0], [0, -1, 1], [3, 0.5, 5.5]]; rows 0, 2 x cols 1, 2
    block = synapses(rho, encoder_v, torch.tensor([[0, 2]]), torch.tensor([[1, 2]]))
    assert block.tolist() == [[[2.0, 0.0], [0.5, 5.5]]]
    assert strongest(block, 2) == [(0, 1, 1, 5.5), (0, 0, 0, 2.0)]


def test_the_state_read_is_the_one_the_forward_leaves():
    model = tiny_model(position="alibi").eval()
    ids = [3, 1, 4, 1, 5]
    state = model.init_state(1)
    with torch.no_grad():
        model.forward_hidden(torch.tensor([ids]), state)
    assert torch.equal(read_state(model, ids, 1), state.rho[1][0])


def test_roc_auc_is_the_hand_counted_share_of_ordered_pairs():
    labels = torch.tensor([0, 0, 1, 1])
    # pairs (positive, negative): (0.35 > 0.1), (0.35 < 0.4), (0.8 > both): 3 of 4
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), labels) == 0.75
    assert roc_auc(torch.tensor([0.0, 0.1, 0.2, 0.3]), labels) == 1.0
    assert roc_auc(torch.tensor([0.3, 0.2, 0.1, 0.0]), labels) == 0.0
    # ties count one half: (1 vs 1) 0.5, (1 vs 0) 1, (2 vs both) 2 -> 3.5 / 4
    assert roc_auc(torch.tensor([1.0, 0.0, 1.0, 2.0]), labels) == 0.875


def test_the_probe_finds_a_planted_synapse_and_a_random_one_is_chance():
    generator = torch.Generator().manual_seed(0)
    labels = [True] * 200 + [False] * 200
    features = torch.randn(400, 30, generator=generator)
    features[:200, 7] -= 10.0  # the concept's synapse, weaker with it: far apart in both halves
    probe = concept_probe(features, labels, count=3)
    assert probe.features[0] == 7 and probe.held_out_auc[0] == 1.0
    assert probe.train_counts == (100, 100) and probe.held_out_counts == (100, 100)
    held = torch.arange(1, 400, 2)  # the odd members of each class
    chance = roc_auc(features[held, 3], torch.tensor(labels)[held])
    assert abs(chance - 0.5) < 0.1


def test_the_probe_chooses_on_the_even_texts_of_each_class_and_judges_on_the_odd():
    """Texts alternate with and without the concept; in each class the 1st and 3rd train,
    the 2nd and 4th are held out. Feature 0 separates the training texts and is reversed on
    the held-out ones: chosen, with held-out AUC 0 (an AUC over the training texts would be
    1). Feature 1 separates only the held-out texts, by more: not chosen (separation 0)."""
    labels = [True, False] * 4  # with: texts 0, 2, 4, 6; without: 1, 3, 5, 7
    features = torch.zeros(8, 2)
    features[[0, 4], 0] = 1.0  # training texts with the concept: 1, without: 0
    features[[3, 7], 0] = 1.0  # held out: without the concept 1, with it 0
    features[[2, 6], 1] = 2.0  # held out with the concept only
    probe = concept_probe(features, labels, count=1)
    assert probe.features == [0] and probe.held_out_auc == [0.0]
    assert probe.separation == [pytest.approx(2.0, abs=1e-12)]  # (1 - 0) / std(1, 1, 0, 0)
    assert probe.train_counts == (2, 2) and probe.held_out_counts == (2, 2)
    both = concept_probe(features, labels, count=2)
    assert both.features == [0, 1] and both.separation[1] == 0.0


@pytest.mark.parametrize(
    "labels",
    [[True] * 3, [True, False, False], [False] * 4, [True, False] * 2, [True] * 3 + [False] * 9],
)
def test_a_probe_without_two_texts_of_each_class_in_each_half_is_refused(labels):
    with pytest.raises(BDHTrainError, match="at least 4 prompts with the concept and 4 without"):
        concept_probe(torch.zeros(len(labels), 3), labels)


def test_separation_is_the_mean_difference_over_the_training_spread_by_hand():
    labels = [True, True, True, True, False, False, False, False]
    # training texts: the even members of each class (rows 0, 2 with; 4, 6 without)
    features = torch.tensor(
        [
            # f0: with 3, 5; without 0, 0 -> mean gap 4; all four 3, 5, 0, 0: mean 2,
            #     variance (1 + 9 + 4 + 4) / 4 = 4.5 -> 4 / sqrt(4.5) = 1.885618...
            # f1: each class constant (with 1, without 2): no spread within either class,
            #     -1 / std(1, 1, 2, 2) = -1 / 0.5 = -2, the bound
            # f2: the same on every training text: 0, not 0 / 0
            [3.0, 1.0, 7.0],
            [9.0, 9.0, 9.0],
            [5.0, 1.0, 7.0],
            [9.0, 9.0, 9.0],
            [0.0, 2.0, 7.0],
            [-9.0, -9.0, -9.0],
            [0.0, 2.0, 7.0],
            [-9.0, -9.0, -9.0],
        ]
    )
    probe = concept_probe(features, labels, count=3)
    assert probe.features == [1, 0, 2]
    assert probe.separation == pytest.approx([-2.0, 4 / 4.5**0.5, 0.0], abs=1e-10)
    assert probe.train_counts == (2, 2) and probe.held_out_counts == (2, 2)
    # held out (rows 1, 3 with 9; 5, 7 without -9): f0 rises with the concept as in training
    # (1); f1 falls with it in training but rises here (0: the reverse side); f2's
    # separation 0 scores every text alike (0.5)
    assert probe.held_out_auc == [0.0, 1.0, 0.5]
    assert probe.chance_auc_1 == pytest.approx(1 / 6, abs=1e-15)  # 1 of C(4, 2) orders


def test_a_synapse_weaker_with_the_concept_scores_auc_1_where_it_stays_weaker():
    labels = [True] * 4 + [False] * 4
    values = torch.tensor([1.0, 2.0, 1.5, 2.5, 5.0, 6.0, 5.5, 6.5]).view(-1, 1)
    probe = concept_probe(values, labels, count=1)
    assert probe.separation[0] < 0 and probe.held_out_auc == [1.0]
    held = torch.tensor([1, 3, 5, 7])
    raw = roc_auc(values[held, 0], torch.tensor(labels)[held])
    assert raw == 0.0  # unoriented: every held-out text with the concept below


def test_synapse_report_reads_the_probe_neurons_block_of_each_prompt():
    model = tiny_model(position="alibi").eval()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2]]
    prompts += [[1, 1], [3, 2, 1], [7], [8, 9]]
    labels = [True, True, False, False] * 2
    report = synapse_report(model, prompts, labels, layer=0, size=5, count=4)
    assert report["prompts"] == ["1 2 3", "4 5", "6 7 8 9", "2 2", "1 1", "3 2 1", "7", "8 9"]
    rho = read_state(model, prompts[0], 0)
    top = report["strongest"][0][0]
    sigma = rho[top["head"]] @ model.encoder_v[top["head"]].detach()
    assert top["value"] == pytest.approx(float(sigma[top["from"], top["to"]]), abs=1e-5)
    assert report["neurons_per_head"] == 5 and len(report["probe"]["synapses"]) == 4
