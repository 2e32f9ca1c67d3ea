"""A data-parallel run resumed on another number of processes continues as the original would
have: the global batch rows, their carried streaming state and the loader position do not
depend on how many processes hold them. Evaluation split over the ranks equals one process."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from helpers import (
    DISTRIBUTED_RUN,
    STREAMING_TBPTT_SETTINGS,
    assert_close,
    checkpoint_weights,
    metric_column,
    run_multiprocess,
    tiny_model,
    train_in_group,
)

from bdh_train.data import RandomWindowLoader, load_tokens
from bdh_train.errors import CheckpointError, ConfigError
from bdh_train.train.evaluate import evaluate
from bdh_train.train.reduce import all_reduce_sums
from bdh_train.train.state import TrainerState, regroup_rank_payloads
from bdh_train.train.step import LanguageTrainModel

MODES = {
    "random-windows": DISTRIBUTED_RUN,
    "streaming-tbptt": [*DISTRIBUTED_RUN, *STREAMING_TBPTT_SETTINGS],
}
STOP_AT_STEP = 3


class _CountingEval:
    """An eval step that records how many batches it was given."""

    def __init__(self, model) -> None:
        self.step, self.batches = LanguageTrainModel(model), 0

    def eval_loss(self, batch):
        self.batches += 1
        return self.step.eval_loss(batch)


def _evaluate(rank: int = 0, world: int = 1) -> tuple[float, int, int]:
    """(val_loss, counted tokens, batches this process evaluated) of a fixed tiny model on 5
    eval batches of the builtin corpus's first tokens."""
    corpus = load_tokens("builtin:pydoc")
    data = dataclasses.replace(corpus, tokens=corpus.tokens[: 5 * 2 * 8 + 1])
    counting = _CountingEval(tiny_model(seed=3, vocab_size=256))
    reduce = all_reduce_sums if world > 1 else None
    result = evaluate(counting, data, 8, 2, None, part=(rank, world), add_across_ranks=reduce)
    return result.val_loss, result.tokens, counting.batches


def _two_processes(rank: int, world: int, base: str) -> tuple[float, int, int]:
    """Every mode's uninterrupted run and its run stopped after STOP_AT_STEP steps; and the
    evaluation of a fixed model split over the two processes."""
    for mode, overrides in MODES.items():
        train_in_group(Path(base, mode, "whole"), overrides, rank, world)
        accumulation = 2
        train_in_group(
            Path(base, mode, "split"),
            overrides,
            rank,
            world,
            stop_after=STOP_AT_STEP * accumulation,
        )
    return _evaluate(rank, world)


def _resume_four(rank: int, world: int, base: str) -> None:
    for mode, overrides in MODES.items():
        train_in_group(Path(base, mode, "on-4"), overrides, rank, world, resume=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_two_process_run_resumes_on_one_and_on_four_processes_and_evaluates_split(tmp_path):
    evaluations = run_multiprocess(
        _two_processes, tmp_path / "group2", str(tmp_path), world=2, timeout=180
    )
    val_loss, tokens, batches = _evaluate()
    assert batches == 5 and [e[2] for e in evaluations] == [3, 2]  # every other batch each
    for rank_loss, rank_tokens, _ in evaluations:  # the sums differ only in their order
        assert rank_tokens == tokens and abs(rank_loss - val_loss) <= 1e-12 * val_loss
    for mode in MODES:
        for copy in ("on-1", "on-4"):
            shutil.copytree(tmp_path / mode / "split", tmp_path / mode / copy)
        train_in_group(tmp_path / mode / "on-1", MODES[mode], resume=True)
    run_multiprocess(_resume_four, tmp_path / "group4", str(tmp_path), world=4, timeout=180)
    for mode in MODES:
        whole = tmp_path / mode / "whole"
        expected_weights, expected_losses = checkpoint_weights(whole), metric_column(whole, "loss")
        assert len(expected_losses) == 6
        for copy in ("on-1", "on-4"):
            run = tmp_path / mode / copy
            weights = checkpoint_weights(run)
            assert weights.keys() == expected_weights.keys()
            for name, value in expected_weights.items():
                assert_close(weights[name], value, rtol=1e-5, msg=f"{mode} {copy} {name}")
            assert_close(
                metric_column(run, "loss"), expected_losses, rtol=1e-5, msg=f"{mode} {copy} losses"
            )
            # step 6's validation: split over 2 ranks in `whole`, over 1 or 4 here
            assert_close(
                metric_column(run, "val_loss")[-1],
                metric_column(whole, "val_loss")[-1],
                rtol=1e-5,
                msg=f"{mode} {copy} val_loss",
            )


def test_regrouping_deals_the_global_rows_of_the_carried_state():
    import torch

    def payload(rows: list[int], tag: int) -> dict:
        carried = {
            "position": torch.tensor(rows),
            "rho.0": torch.tensor(rows, dtype=torch.float32).view(-1, 1, 1, 1),
        }
        return {
            "rng": tag,
            "train_step": {"gradient_scales": {}, "carried_state": carried},
            "accumulator": "empty",
            "gradient_scales": {},
        }

    two = [payload([0, 1, 2, 3], 0), payload([4, 5, 6, 7], 1)]
    four = [regroup_rank_payloads(two, rank, 4) for rank in range(4)]
    assert [p["train_step"]["carried_state"]["position"].tolist() for p in four] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert [p["rng"] for p in four] == [0, 0, 1, 1]
    one = regroup_rank_payloads(two, 0, 1)
    assert one["train_step"]["carried_state"]["rho.0"].view(-1).tolist() == list(range(8))


def test_resume_on_another_process_count_is_refused_mid_window_and_for_uneven_rows(tmp_path):
    counters = {
        "step": 1,
        "micro": 1,
        "tokens": 96,
        "skips": 0,
        "window_loss": 5.0,
        "window_count": 32.0,
        "elapsed": 1.0,
        "world_size": 2,
    }
    with pytest.raises(CheckpointError, match="1 micro-step.*by 2 processes; resume it with 2"):
        TrainerState(world_size=1).load_state_dict(counters)
    TrainerState(world_size=4).load_state_dict({**counters, "micro": 0})  # a step boundary
    with pytest.raises(ConfigError, match="run 1, 2, 4 processes, or pick a batch_size"):
        RandomWindowLoader(load_tokens("builtin:pydoc"), 8, 4, seed=0, rank=0, world_size=3)
