"""Neuron activity recorded from the model's own forward (model/activity.py, inspect/
activity.py) against hand counts: planted always-on and dead neurons in a model whose weights
fix every neuron's sign, and the more-than-half rule on chosen tensors."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from bdh_train.data.tokens import TokenData
from bdh_train.inspect.neuron_activity import InspectRecorder, record_activity
from bdh_train.model.activity import ActivityCounts, recording
from bdh_train.model.config import LanguageHeadConfig
from bdh_train.train.evaluate import Evaluator, _summed
from bdh_train.train.step import LanguageTrainModel

# Per head, per neuron: (sign of its encoder column, sign of its encoder_v column) along e0.
# Every norm site adds the bias 10 * e0 to a unit-variance row of D = 8 values (each below
# sqrt(7) in size), so u[0] and a[0] lie in (7, 13): x_n = relu(+-u[0]), pre_n = +-a[0].
PLANT = [[(1, 1), (-1, 1), (1, -1), (-1, -1)], [(1, 1), (1, 1), (1, -1), (-1, 1)]]
# head 0: x on for neurons 0, 2; y on for 0, 1; xy on for 0.  head 1: x on 0, 1, 2; y on 0, 1, 3
EXPECTED = {"x": [0.5, 0.75], "y": [0.5, 0.75], "xy": [0.25, 0.5]}
EXPECTED_DEAD = [0.5, 0.25]  # head 0: neurons 1, 3; head 1: neuron 3
EXPECTED_ON = [0.5, 0.75]


def planted_model():
    model = tiny_model(
        n_embd=8, n_head=2, mlp_internal_dim_multiplier=1, norm="layernorm_affine"
    )  # N = 1 * 8 / 2 = 4
    with torch.no_grad():
        model.norm.weight.fill_(1.0)
        model.norm.bias.zero_()
        model.norm.bias[0] = 10.0
        model.encoder.zero_()
        model.encoder_v.zero_()
        for h, neurons in enumerate(PLANT):
            for n, (sign_x, sign_y) in enumerate(neurons):
                model.encoder[h, 0, n] = sign_x
                model.encoder_v[h, 0, n] = sign_y
    return model.eval()


def test_planted_neurons_give_the_hand_counted_activity():
    model = planted_model()
    idx = torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(0))
    counts = ActivityCounts(2, 2, 4)
    with torch.no_grad():
        plain = model.forward_hidden(idx)
        with recording(model, counts):
            recorded = model.forward_hidden(idx)
    assert model.recorder is None
    assert torch.equal(plain, recorded)  # recording changes nothing
    assert counts.tokens.tolist() == [15, 15]
    for name, per_head in EXPECTED.items():
        assert counts.shares()[name].tolist() == [per_head, per_head], name
    assert counts.dead().tolist() == [EXPECTED_DEAD] * 2
    assert counts.always_on().tolist() == [EXPECTED_ON] * 2
    firing = [[15 * (sx > 0) for sx, _ in neurons] for neurons in PLANT]
    assert counts.fires.tolist() == [firing, firing]
    row = counts.row()
    assert row["x_active"] == 0.625 and row["x_active_l1"] == 0.625
    assert row["xy_active"] == 0.375 and row["dead"] == 0.375 and row["always_on"] == 0.625


def test_more_than_half_is_always_on_and_never_is_dead():
    counts = ActivityCounts(1, 1, 4)
    x = torch.tensor([[1.0, 2, -1, 0], [0, 1, 0, 4], [3, 1, 0, 0], [0, -2, -5, 0]])
    pre = torch.tensor([[1.0, -1, 1, 1], [1, 1, 1, 1], [-1, 0, 1, 1], [1, 1, 1, 1]])
    counts.record(x.view(1, 1, 4, 4), pre.view(1, 1, 4, 4))
    # on 4 tokens: neuron 0 fires on 2 (half: not always on), 1 on 3, 2 never, 3 once
    assert counts.fires.tolist() == [[[2, 3, 0, 1]]]
    assert counts.always_on().tolist() == [[1 / 4]]
    assert counts.dead().tolist() == [[1 / 4]]
    shares = counts.shares()
    assert shares["x"].item() == 6 / 16 and shares["y"].item() == 13 / 16
    # x > 0 and pre > 0: (token 0, neuron 0), (token 1, neuron 1), (token 1, neuron 3)
    assert shares["xy"].item() == 3 / 16


def test_the_evaluator_records_the_activity_of_its_own_forwards():
    model = planted_model()
    tokens = torch.randint(0, 32, (200,), generator=torch.Generator().manual_seed(1)).numpy()
    data = TokenData(tokens, 32, "test")
    evaluator = Evaluator(
        LanguageTrainModel(model),
        data,
        8,
        2,
        3,
        "cpu",
        None,
        LanguageHeadConfig(),
        None,
        activity_of=model,
    )
    row = evaluator.run().row()
    assert row["x_active"] == 0.625 and row["y_active_l0"] == 0.625 and row["dead"] == 0.375
    evaluator.activity_of = None
    plain = evaluator.run().row()
    assert plain == {"val_loss": row["val_loss"]}


def test_counts_summed_over_ranks_keep_their_shapes():
    counts = [torch.arange(6).view(2, 3), torch.tensor([7])]
    summed = _summed(counts, lambda values: [2 * v for v in values])
    assert [s.tolist() for s in summed] == [[[0, 2, 4], [6, 8, 10]], [14]]
    assert all(s.dtype == torch.int64 for s in summed)


def test_inspect_recorder_keeps_each_neurons_top_tokens_and_token_shares():
    model = planted_model()
    tokens = torch.randint(0, 32, (21,), generator=torch.Generator().manual_seed(2))
    recorder = InspectRecorder(2, 2, 4, dashboard_layer=1, top_k=3)
    record_activity(model, tokens, block_size=4, batch_size=2, recorder=recorder)
    assert recorder.tokens.tolist() == [21, 21] and recorder.offset == 21
    # per token, the share of all 8 neurons with x > 0: 5 of 8 (heads 0 and 1: 2 + 3)
    assert recorder.token_shares().tolist() == [[0.625] * 21] * 2
    # the slow twin: the layer's x on each token, from one forward with the recorder capturing
    captured = []

    class Capture:
        layer = 0

        def record(self, x, pre):
            if self.layer == 1:
                captured.append(x)

    rows = [tokens[i : i + 4] for i in range(0, 20, 4)] + [tokens[20:]]
    with torch.no_grad(), recording(model, Capture()):
        for row in rows:
            model.forward_hidden(row.view(1, -1))
    x = torch.cat([c[0].permute(1, 0, 2) for c in captured])  # [tokens, H, N]
    best = x.topk(3, dim=0)
    assert torch.equal(recorder.top_values, best.values.permute(1, 0, 2))
    picked = x.gather(0, recorder.top_tokens.permute(1, 0, 2))
    assert torch.equal(picked, best.values)


def test_the_dashboard_ranks_by_selectivity_and_sets_always_on_neurons_apart():
    from bdh_train.inspect.analysis import InspectOptions, dashboard, neuron_selectivity

    # one layer, one head, 4 neurons over 8 tokens; the dashboards keep each neuron's top 2
    x = torch.tensor(
        [
            [1.0] * 8,  # 0: on every token: always on, shown apart
            [5.0, 4.0, 0, 0, 0, 0, 0, 1.0],  # 1: top 2 hold 9 of 10 -> 0.9 / (2 / 8) = 3.6
            [1.0, 1.0, 1.0, 1.0, 0, 0, 0, 0],  # 2: on half (not more): 2 of 4 -> 2.0
            [0, 0, 0, 0, 0, 0, 0, 2.0],  # 3: fires on 1 token, fewer than the top 2
        ]
    ).T.reshape(1, 1, 8, 4)  # [B, H, T, N]
    recorder = InspectRecorder(1, 1, 4, dashboard_layer=0, top_k=2)
    recorder.record(x, x)
    selectivity, share = neuron_selectivity(recorder)
    assert share[0].tolist() == pytest.approx([0.25, 0.9, 0.5, 1.0], abs=1e-12)
    assert selectivity[0].tolist() == pytest.approx([1.0, 3.6, 2.0, 4.0], abs=1e-12)
    options = InspectOptions(dashboard_neurons=3, top_k=2, context=1)
    numbers, rows, always_on = dashboard(recorder, torch.arange(8), None, options)
    # by firing rate the order would be 0, 2, 1, 3
    assert [n["neuron"] for n in numbers] == [1, 2]
    assert [n["selectivity"] for n in numbers] == pytest.approx([3.6, 2.0], abs=1e-12)
    expected = [[0, 1, 3.6, 3 / 8, 5.0], [0, 1, 3.6, 3 / 8, 4.0]]
    expected += [[0, 2, 2.0, 0.5, 1.0]] * 2
    for row, want in zip(rows, expected, strict=True):
        assert row[:5] == pytest.approx(want, abs=1e-12)
    assert always_on == {
        "count": 1,
        "neurons": [{"layer": 0, "head": 0, "neuron": 0, "firing_rate": 1.0, "mean_x": 1.0}],
    }
