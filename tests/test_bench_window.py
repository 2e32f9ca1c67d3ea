"""benchmarks/window.py (the state recipe's control) and recall.py's curriculum: the three
readings of the second block against a model whose prediction is known by hand, the paired
difference's mean and standard error, the pairs each training batch holds, and the precision
recall's arms train in."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import recall  # noqa: E402
import window  # noqa: E402

from bdh_train.batch import IGNORE_INDEX  # noqa: E402

VOCAB, SURE = 4, 5.0


class FirstToken(torch.nn.Module):
    """Predicts, at every position, the first token of its input (logit SURE on it, 0 on the
    others): which tokens a reading gave it is read off its losses."""

    def forward(self, x, y):
        logits = torch.zeros(*x.shape, VOCAB)
        logits[..., :] = SURE * torch.nn.functional.one_hot(x[:, :1], VOCAB).float()
        return logits, None


def test_readings_give_each_target_its_context():
    block = 4
    windows = torch.randint(
        0, VOCAB, (10, 2 * block + 1), generator=torch.Generator().manual_seed(0)
    )
    got = window.readings(FirstToken(), windows, block)
    right = math.log(math.exp(SURE) + VOCAB - 1) - SURE
    wrong = math.log(math.exp(SURE) + VOCAB - 1)
    w = windows.tolist()
    for name, first in [
        ("two blocks", lambda r, j: w[r][0]),  # the whole window
        ("block only", lambda r, j: w[r][block]),  # the second block alone
        ("one block", lambda r, j: w[r][j + 1]),  # the block tokens ending at position block + j
    ]:
        expected = [
            [right if w[r][block + 1 + j] == first(r, j) else wrong for j in range(block)]
            for r in range(len(w))
        ]
        np.testing.assert_allclose(got[name], expected, rtol=0, atol=1e-5, err_msg=name)


def test_difference_is_the_mean_over_windows_and_its_standard_error():
    a = np.array([[2.0, 4.0, 0.0], [5.0, 5.0, 9.0]])
    b = np.zeros_like(a)
    # per-window means 3 and 5 over offsets 0-1: mean 4, sd sqrt(2), se sqrt(2) / sqrt(2) = 1
    assert window.difference(a, b, 0, 2) == "+4.0000 ± 1.0000"
    # all offsets: means 2 and 19/3, mean 25/6, sd (13/3) / sqrt(2), se 13/6
    assert window.difference(a, b) == f"{25 / 6:+.4f} ± {13 / 6:.4f}"


def test_curriculum_gives_each_batch_its_pairs():
    task = recall.Task(16, 64, 64, 2, 0, ((4, 10), (8, 20)))
    assert [task.pairs_at(k) for k in (0, 9, 10, 19, 20, 99)] == [4, 4, 8, 8, 16, 16]
    for k, pairs in [(3, 4), (12, 8), (25, 16)]:
        _, targets = task.batch_at(k)
        assert ((targets != IGNORE_INDEX).sum(dim=1) == pairs).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_recall_arm_trains_in_its_configs_precision(dtype):
    """A recall arm's priming and steps run their forward under bfloat16 autocast exactly when
    its config's training.dtype asks for it, as recipe.py's arms do."""
    micro = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", f"training.dtype={dtype}"]
    rec = recall.Recipe("tiny", (*micro, "model.vocab_size=64"))
    bdh = recall.bdh_arm(rec, "adamw", [], 1.0, "b", streamed=False)
    arms = [recall.RecallArm.of(bdh), recall.RecallArm.of(recall.gpt_arm(rec, "adamw", 5000, 1.0))]
    task = recall.Task(4, 32, 64, 2, 0)
    for arm in arms:
        seen: list[bool] = []
        arm.model.register_forward_pre_hook(
            lambda *_, seen=seen: seen.append(torch.is_autocast_enabled("cpu"))
        )
        arm.prime(task)
        arm.step(task)
        assert seen == [dtype == "bfloat16"] * 2, arm.model_name


def test_recall_reads_its_task_and_model_from_a_config(capsys, monkeypatch):
    """configs/mqar.toml names the task (pairs in 64 tokens, 64 ids) and the BDH: at width
    16 (2 heads of 8 * 16 / 2 = 64 neurons) it has 3 * 2 * 16 * 64 + 2 * 64 * 16 = 8,192
    parameters and is scored at 64, 128 and 256 tokens."""
    monkeypatch.setattr(recall, "configure_host_allocator", lambda mode, device: "system")
    monkeypatch.setattr(recall.torch, "set_num_threads", lambda threads: None)
    config = Path(__file__).resolve().parents[1] / "configs" / "mqar.toml"
    recall.main(
        ["--config", str(config), "--steps", "1", "--every", "1", "--eval-examples", "1"]
        + ["--batch", "2", "--no-gpt", "--set", "model.n_embd=16", "--set", "data.mqar.pairs=8"]
    )
    out = capsys.readouterr().out
    assert "MQAR: 8 pairs, 64 tokens, vocabulary 64" in out
    assert "| acc @64 | acc @128 | acc @256 |" in out
    row = next(line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| BDH"))
    assert [c.strip() for c in row[1:3]] == ["8,192", "1"]
