"""A training checkpoint's parts (train/state.py): `TrainingCheckpoints` is built from named
parts and writes each to its own file, which a second one loads back."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from bdh_train.distributed.env import DistContext
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage.run_dir import RunDir
from bdh_train.train.config import TrainingConfig
from bdh_train.train.state import (
    CheckpointParts,
    RankStates,
    TrainerState,
    TrainingCheckpoints,
    model_metadata,
)


class Counter:
    """A stateful part holding one number."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _checkpoints(run: Path, seed: int, step: int) -> tuple[TrainingCheckpoints, CheckpointParts]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainerState(step=step, tokens=10 * step)
    one = DistContext()
    ranks = RankStates(Counter(seed), Counter(seed), Counter(seed), state, one, one, False)
    parts = CheckpointParts(
        model=model,
        optimizer=optimizer,
        state=state,
        loader=Counter(100 + seed),
        ranks=ranks,
        model_metadata=partial(model_metadata, {"n_embd": 2}, state),
        saved={"config.toml": "a = 1\n"},
    )
    training = TrainingConfig(max_steps=10)
    return TrainingCheckpoints(RunDir(run), training, parts, is_main=True, dcp=False), parts


def test_training_checkpoints_are_built_from_named_parts_and_load_them_back(tmp_path):
    with pytest.raises(TypeError):
        CheckpointParts(*range(7))  # type: ignore[misc]  # the parts are named
    saver, saved = _checkpoints(tmp_path, seed=1, step=3)
    final = saver.save(3, 0)
    assert final == tmp_path / "checkpoints" / "step-0000003"
    assert sorted(p.name for p in final.iterdir()) == sorted(
        [
            "config.toml",
            "loader.json",
            ckpt.MANIFEST,
            ckpt.MODEL_FILE,
            "optimizer.pt",
            "ranks.pt",
            "trainer.json",
        ]
    )
    with safe_open(str(final / ckpt.MODEL_FILE), "pt") as handle:
        metadata = handle.metadata()
    assert metadata == {ckpt.MODEL_CONFIG_KEY: json.dumps({"n_embd": 2}), "step": "3"}
    loader, loaded = _checkpoints(tmp_path, seed=2, step=0)
    loader.load(final)
    assert loaded.state.step == 3 and loaded.state.tokens == 30
    assert loaded.loader.state_dict() == {"value": 101}
    assert loaded.ranks.executor.state_dict() == {"value": 1}
    for mine, theirs in zip(loaded.model.parameters(), saved.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
