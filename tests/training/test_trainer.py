"""The training loop end to end on micro configs: bit-exact resume (also from the
middle of an accumulation window), crash-safe checkpoints, non-finite steps, DDP == 1 process."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    FRESH_BLOCKS,
    STREAMING_TBPTT_SETTINGS,
    assert_close,
    assert_same_run,
    checkpoint_weights,
    cli_as_rank,
    cli_main,
    metric_rows,
    run_multiprocess,
    set_args,
    start_process,
)
from safetensors.torch import load_file

from bdh_train.cli import main
from bdh_train.config import load_config
from bdh_train.data import DataConfig, StreamingCorpusLoader
from bdh_train.errors import ConfigError
from bdh_train.model.groups import interface_surface_params, transferred_backbone_params
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage.run_dir import RunDirLock, RunDirLost
from bdh_train.train import throughput
from bdh_train.train.config import TrainingConfig
from bdh_train.train.evaluate import Evaluator
from bdh_train.train.metrics import MetricsReporter, read_metrics
from bdh_train.train.profile import PROBES
from bdh_train.train.state import TrainingCheckpoints
from bdh_train.train.step import LanguageTrainModel
from bdh_train.train.window import StepWindow, TrainingDiverged
from bdh_train.training.trainer import Trainer

MICRO = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=4",
    "model.dropout=0.1",
    "training.block_size=16",
    "training.batch_size=4",
    "training.log_every=1",
    "training.eval_every=5",
    "training.eval_steps=2",
    "training.checkpoint_every=5",
    "training.keep_checkpoints=0",
    "training.max_steps=20",
    "optimizer.warmup_steps=3",
    "optimizer.schedule='cosine'",
    "optimizer.min_lr=1e-4",
]
RANDOM_ACCUM = [*MICRO, "training.gradient_accumulation_steps=3"]
STREAMING_TBPTT = [
    *MICRO,
    *STREAMING_TBPTT_SETTINGS,
]


@pytest.mark.parametrize(
    "overrides", [RANDOM_ACCUM, STREAMING_TBPTT], ids=["random-windows-accum3", "streaming-tbptt"]
)
@pytest.mark.parametrize("stop_micro", [None, 1], ids=["at-step-boundary", "mid-window"])
def test_resume_is_bit_exact(tmp_path, overrides, stop_micro):
    cfg = load_config(overrides=overrides)
    accum = cfg.training.accumulation_steps
    whole = tmp_path / "whole"
    Trainer(cfg, whole, stream=io.StringIO()).run()

    split = tmp_path / "split"
    stop_after = 10 * accum + (stop_micro or 0)
    first = Trainer(load_config(overrides=overrides), split, stream=io.StringIO())
    result = first.run(stop_after_micro_steps=stop_after)
    assert result.stopped_early
    assert (first.state.step, first.state.micro) == (10, stop_micro or 0)
    if stop_micro:
        assert result.checkpoint.name == "step-0000010-m01"
        assert first.accumulator.state.microbatches == 1  # the window really was open
    Trainer(load_config(overrides=overrides), split, resume=True, stream=io.StringIO()).run()

    assert_same_run(whole, split)
    assert len(metric_rows(whole)) == 20 + 4  # 20 train rows, evals at 5, 10, 15, 20


BUDGET = [*MICRO, "training.max_steps=4", "training.eval_every=2", "training.checkpoint_every=0"]


def test_a_run_stopped_by_its_time_budget_resumes_bit_exactly(tmp_path):
    """A clock that reads 10 s per optimizer step taken and training.max_time = '15s': the
    run stops after step 2 (20 s trained) with a checkpoint and says why; a resume with the
    budget spent is refused; with a larger one it trains to step 4, the same weights and
    rows as a run never stopped."""
    whole = tmp_path / "whole"
    Trainer(load_config(overrides=BUDGET), whole, stream=io.StringIO()).run()
    split, log = tmp_path / "split", io.StringIO()
    first = Trainer(load_config(overrides=[*BUDGET, "training.max_time='15s'"]), split, stream=log)
    first.clock = lambda: 10.0 * first.state.step
    result = first.run()
    assert result.stopped_early and result.checkpoint.name == "step-0000002"
    assert (first.state.step, first.state.elapsed) == (2, 20.0)
    assert (
        "time budget spent: 20s of training.max_time = '15s' trained; raise it (or set 0) to "
        "train on"
    ) in log.getvalue().splitlines()
    with pytest.raises(ConfigError, match=r"training.max_time = '15s' is spent: .* 20 s;"):
        Trainer(load_config(overrides=[*BUDGET, "training.max_time='15s'"]), split, resume=True)
    more = load_config(overrides=[*BUDGET, "training.max_time='1h'"])
    Trainer(more, split, resume=True, stream=io.StringIO()).run()
    assert_same_run(whole, split)


def test_max_tokens_sets_the_steps_and_max_time_reads_durations(capsys):
    """max_tokens 100 at 2 x 8 tokens x 3 micro-steps per step: ceil(100 / 48) = 3 steps,
    said once; durations in seconds or h/m/s."""
    t = load_config(
        overrides=[
            "training.block_size=8",
            "training.batch_size=2",
            "training.gradient_accumulation_steps=3",
            "training.max_tokens=100",
        ]
    ).training
    assert t.max_steps == 3
    assert "info: training.max_steps = 3: training.max_tokens = 100 at 48 tokens per " in (
        capsys.readouterr().err
    )
    t.validate()
    assert capsys.readouterr().err == ""  # validated again: unchanged and silent
    for value, seconds in (("2h30m", 9000.0), ("90m", 5400.0), ("1.5h", 5400.0), (45, 45.0)):
        assert dataclasses.replace(t, max_time=value).time_budget_s == seconds
    for bad in ("2 hours", "30m2h", "", -1):
        with pytest.raises(ConfigError, match=r"training.max_time must be a duration: seconds"):
            dataclasses.replace(t, max_time=bad).validate()


def _with_documents(monkeypatch) -> None:
    """The training split cut into documents of 1 to 40 tokens (a seeded index in
    TokenData.doc_starts, as a prepared corpus carries it)."""
    load = DataConfig.load_splits

    def load_with_documents(self, vocab_size, block_size):
        train, val = load(self, vocab_size, block_size)
        lengths = np.random.default_rng(0).integers(1, 41, size=len(train))
        starts = np.cumsum(np.concatenate([[0], lengths]))
        return dataclasses.replace(train, doc_starts=starts[starts < len(train)]), val

    monkeypatch.setattr(DataConfig, "load_splits", load_with_documents)


def test_corpus_document_streaming_resume_mid_document_is_bit_exact(tmp_path, monkeypatch):
    """training.stream_documents = 'corpus': stopped mid-window at step 2 (rows mid-document,
    the carried state holding only each row's current document) and resumed, the run ends
    bit-identical to the uninterrupted one. With model.token_shift, whose carried input
    (ModelState.previous) is saved with the rows' state and dropped where documents start."""
    _with_documents(monkeypatch)
    monkeypatch.setattr(Trainer, "sample", lambda self, *args, **kwargs: None)  # not under test
    overrides = [
        *STREAMING_TBPTT,
        "training.min_logical_block_size=0",
        "training.stream_documents='corpus'",
        "model.token_shift=true",
        "training.max_steps=4",
        "training.eval_every=2",
        "training.checkpoint_every=2",
    ]
    whole = tmp_path / "whole"
    Trainer(load_config(overrides=overrides), whole, stream=io.StringIO()).run()
    split = tmp_path / "split"
    first = Trainer(load_config(overrides=overrides), split, stream=io.StringIO())
    assert isinstance(first.loader, StreamingCorpusLoader)
    first.run(stop_after_micro_steps=2 * 2 + 1)
    assert (first.state.step, first.state.micro) == (2, 1)
    rows = first.loader.state_dict()["rows"]
    assert any(offset > 0 for _, offset in rows)  # some row stopped inside a document
    Trainer(load_config(overrides=overrides), split, resume=True, stream=io.StringIO()).run()
    assert_same_run(whole, split)


def _train_then_die_saving(run_dir: Path) -> None:
    trainer = Trainer(load_config(overrides=MICRO), run_dir, stream=io.StringIO())
    trainer.run(stop_after_micro_steps=3)  # checkpoint step-0000003
    trainer.run(stop_after_micro_steps=2)  # train on to step 5 ...
    trainer.save_checkpoint(before_rename=lambda tmp: os.kill(os.getpid(), signal.SIGKILL))


def test_crash_during_checkpoint_leaves_previous_one_loadable(tmp_path):
    """SIGKILL between the complete temporary write and the rename."""
    run_dir = tmp_path / "run"
    with start_process(_train_then_die_saving, run_dir, stdout=tmp_path / "console") as process:
        process.join(timeout=120)
        assert process.exitcode == -signal.SIGKILL, (tmp_path / "console").read_text()[-3000:]
    latest = ckpt.resolve_checkpoint(run_dir)
    assert latest.name == "step-0000005"  # the completed stop-checkpoint, not the killed one
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert leftovers, "the killed save should have left only its hidden temporary directory"
    resumed = Trainer(load_config(overrides=MICRO), run_dir, resume=True, stream=io.StringIO())
    assert resumed.state.step == 5


def test_failed_save_keeps_pointer_and_cleans_up(tmp_path):
    t = Trainer(load_config(overrides=MICRO), tmp_path, stream=io.StringIO())
    t.run(stop_after_micro_steps=2)

    def boom(_tmp):
        raise OSError("disk full")

    t.state.step += 1
    with pytest.raises(OSError, match="disk full"):
        t.save_checkpoint(before_rename=boom)
    assert ckpt.resolve_checkpoint(tmp_path).name == "step-0000002"
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path, monkeypatch):
    overrides = [
        *MICRO,
        "training.max_consecutive_skips=2",
        "training.checkpoint_every=2",
        "training.eval_every=0",
    ]
    t = Trainer(load_config(overrides=overrides), tmp_path, stream=io.StringIO())
    original = LanguageTrainModel.compute_gradients

    def poisoned(self, batch, loss_scale=1.0):
        out = original(self, batch, loss_scale)
        if t.state.step >= 4:
            self.model.encoder.grad.fill_(float("nan"))
        return out

    monkeypatch.setattr(LanguageTrainModel, "compute_gradients", poisoned)
    with pytest.raises(TrainingDiverged, match="3 consecutive steps had a non-finite") as err:
        t.run()
    assert t.state.step == 6  # steps 5 and 6 skipped and counted, the 7th aborts
    # No checkpoint is written during the streak (step 6 would be one): the newest one is
    # from before it, the message names it, and it holds finite weights and no skip count.
    good = ckpt.resolve_checkpoint(tmp_path)
    assert good.name == "step-0000004"
    assert str(good) in str(err.value)
    weights = load_file(str(good / ckpt.MODEL_FILE))
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert ckpt.read_json(good / "trainer.json")["skips"] == 0


def assert_same_parameters(one: Path, two: Path) -> None:
    a, b = checkpoint_weights(one), checkpoint_weights(two)
    for name in a:
        assert_close(b[name], a[name], rtol=1e-5, msg=name)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ddp_two_processes_equal_one_process(tmp_path):
    """A data-parallel run of 2 processes and `bdh-train train` in one: the same weights
    (fp32 1e-5), the same tokens and losses per step."""
    overrides = [
        *MICRO,
        "model.dropout=0.0",
        "training.max_steps=5",
        "training.gradient_accumulation_steps=2",
        "training.checkpoint_every=5",
        "training.eval_every=0",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    # the ranks forked from the preloaded server with torchrun's environment (the launcher
    # itself is what the torchrun tests here and in test_failures.py start)
    argv = ["train", "--run-dir", str(two), *set_args(overrides)]
    assert run_multiprocess(cli_as_rank, tmp_path / "group", argv, timeout=150) == [0, 0]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--run-dir", str(one), *set_args(overrides)]) == 0
    assert_same_parameters(one, two)
    rows_one, rows_two = metric_rows(one), metric_rows(two)
    assert [r["tokens"] for r in rows_one] == [r["tokens"] for r in rows_two]
    for r1, r2 in zip(rows_one, rows_two, strict=True):
        assert abs(r1["loss"] - r2["loss"]) < 1e-5 * abs(r1["loss"])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_pipeline_training_of_two_processes_equals_one_process(tmp_path):
    """`bdh-train train --set parallel.pipeline_stages=2` (1F1B, accumulation 2) as the two
    ranks of a group, and the same run in one process without the pipeline: the same weights
    and validation loss (fp32 1e-5). Every schedule is compared with one process in
    tests/distributed/test_pipeline_mp.py; a launch through torchrun itself, of a data x
    pipeline mesh, in tests/training/test_failures.py."""
    overrides = [
        *MICRO,
        *FRESH_BLOCKS,
        "model.dropout=0.0",
        "model.n_layer=4",
        "training.max_steps=3",
        "training.gradient_accumulation_steps=2",
        "training.checkpoint_every=3",
        "training.eval_every=3",
    ]
    pipe = ["parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule='1f1b'"]
    one, two = tmp_path / "one", tmp_path / "two"
    argv = ["train", "--run-dir", str(two), *set_args([*overrides, *pipe])]
    assert run_multiprocess(cli_as_rank, tmp_path / "group", argv, timeout=150) == [0, 0]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--run-dir", str(one), *set_args(overrides)]) == 0
    assert_same_parameters(one, two)
    val_one = [r["val_loss"] for r in metric_rows(one) if "val_loss" in r]
    val_two = [r["val_loss"] for r in metric_rows(two) if "val_loss" in r]
    assert abs(val_one[0] - val_two[0]) < 1e-5 * val_one[0]


def test_pipeline_without_enough_processes_is_refused(tmp_path):
    from bdh_train.errors import ConfigError

    pipe = ["parallel.pipeline_stages=2", "parallel.microbatches=2"]
    cfg = load_config(overrides=[*MICRO, *FRESH_BLOCKS, *pipe])
    with pytest.raises(
        ConfigError, match="needs a multiple of 2 processes .* got 1; or set parallel.emulate=true"
    ):
        Trainer(cfg, tmp_path)
    assert not any(tmp_path.iterdir())


def test_emulated_pipeline_trains_in_one_process(tmp_path):
    cfg = load_config(
        overrides=[
            *MICRO,
            *FRESH_BLOCKS,
            "model.dropout=0.0",
            "parallel.pipeline_stages=2",
            "parallel.microbatches=2",
            "parallel.emulate=true",
            "training.max_steps=2",
        ]
    )
    reference = load_config(
        overrides=[*MICRO, *FRESH_BLOCKS, "model.dropout=0.0", "training.max_steps=2"]
    )
    Trainer(cfg, tmp_path / "emu", stream=io.StringIO()).run()
    Trainer(reference, tmp_path / "ref", stream=io.StringIO()).run()
    a, b = checkpoint_weights(tmp_path / "emu"), checkpoint_weights(tmp_path / "ref")
    for name in a:
        assert_close(a[name], b[name], rtol=1e-5, msg=name)


def test_nca_data_with_factorized_head_trains(tmp_path):
    config = Path(__file__).parents[2] / "configs" / "nca.toml"
    cfg = load_config(
        [config], [*MICRO, "model.vocab_size=19", "training.max_steps=4", "data.nca.grid_size=4"]
    )
    result = Trainer(cfg, tmp_path, stream=io.StringIO()).run()
    assert result.sample is None  # no flat logits for this head
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 4 and all(r["loss"] > 0 for r in rows)
    assert "bits_per_byte" not in read_metrics(tmp_path / "metrics.jsonl")[-1]


def test_bitnet_warmup_follows_the_trainer_step(tmp_path, capsys):
    """The warm-up's lambda follows the step in training, and through a resume; the last
    evaluation uses the lambda of the step it reports, and so does every reader of the
    checkpoint: `eval --batches 2` gives train's last val_loss mid-warm-up."""
    config = Path(__file__).parents[2] / "configs" / "bitnet.toml"
    cfg = load_config([config], [*MICRO, "model.quant.warmup_steps=4", "training.max_steps=3"])
    trainer = Trainer(cfg, tmp_path, stream=io.StringIO())
    lambdas = []
    real_set = trainer.model.set_quant_step
    trainer.model.set_quant_step = lambda step: lambdas.append(step) or real_set(step)
    trainer.run()
    assert lambdas == [0, 1, 2, 3]  # a step each, then the evaluation at step 3
    assert trainer.model.quantizer.lam == pytest.approx(3 / 4)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    trained = [row["val_loss"] for row in rows if "val_loss" in row][-1]
    assert main(["eval", "--checkpoint", str(tmp_path), "--batches", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] == pytest.approx(trained, rel=1e-6)
    hf = tmp_path.with_name(tmp_path.name + "-hf")  # the HF code computes only lambda 0 or 1
    assert main(["export", "--hf", str(hf), str(tmp_path)]) == 2 and not hf.exists()
    assert "in its quantization warm-up (lambda = 0.75)" in capsys.readouterr().err
    cfg.training.max_steps = 4  # one more step (resuming at max_steps is refused)
    resumed = Trainer(cfg, tmp_path, resume=True, stream=io.StringIO())
    resumed.run()
    assert resumed.model.quantizer.lam == pytest.approx(4 / 4)


def _first_loss_and_params(tmp_path, extra):
    cfg = load_config(
        overrides=[
            *MICRO,
            "model.dropout=0.0",
            "training.max_steps=2",
            "training.eval_every=0",
            *extra,
        ]
    )
    trainer = Trainer(cfg, tmp_path, stream=io.StringIO())
    trainer.run()
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    return rows, dict(trainer.model.named_parameters())


def _eager_and_compiled(tmp_path, mode: str):
    """Two steps of TBPTT chunks 6 + 6 + 4 with a state carried from step to step and an
    evaluation, eager and with training.compile = `mode` (a graph rebuilt raises) -> (eager
    rows and parameters, compiled rows and parameters, graphs built)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tbptt = ["training.tbptt_chunk_size=6", "training.tbptt_persist_across_steps=true"]
    evaluate = ["training.eval_every=2"]
    eager = _first_loss_and_params(tmp_path / "eager", [*tbptt, *evaluate])
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _first_loss_and_params(
            tmp_path / mode, [*tbptt, *evaluate, f"training.compile='{mode}'"]
        )
    return eager, compiled, counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.compiles
def test_compiled_layers_train_like_eager_and_compile_once(tmp_path):
    """training.compile = 'layer': one graph, never rebuilt, and the weights of eager training
    to fp32 1e-5. The shorter tail and the evaluation run the eager layer."""
    (eager_rows, eager), (rows, compiled), graphs = _eager_and_compiled(tmp_path, "layer")
    assert graphs == 1
    assert abs(rows[0]["loss"] - eager_rows[0]["loss"]) < 1e-5 * eager_rows[0]["loss"]
    for name, p in compiled.items():
        assert_close(p, eager[name], rtol=1e-5, msg=name)


@pytest.mark.compiles
def test_the_compiled_fused_gate_trains_bit_for_bit_like_eager(tmp_path):
    """training.compile = 'pointwise' (inductor's gate kernels): the same losses and weights
    as eager training, bit for bit; one graph each way, never rebuilt for the shorter tail."""
    (eager_rows, eager), (rows, fused), graphs = _eager_and_compiled(tmp_path, "pointwise")
    assert graphs == 2
    assert [r["loss"] for r in rows] == [r["loss"] for r in eager_rows]
    for name, p in fused.items():
        assert torch.equal(p, eager[name]), name


def test_layer_recompute_trains_like_keeping_everything(tmp_path):
    """training.recompute = 'layer' on a streaming TBPTT run with dropout: the same metrics
    (losses, gradient norms, validation) as 'none', to fp32 rounding."""
    rows = {}
    for mode in ("none", "layer"):
        cfg = load_config(
            overrides=[
                *STREAMING_TBPTT,
                "training.max_steps=2",
                "training.eval_every=2",
                "training.checkpoint_every=0",
                f"training.recompute='{mode}'",
            ]
        )
        trainer = Trainer(cfg, tmp_path / mode, stream=io.StringIO())
        assert trainer.model.recompute == mode
        trainer.run()
        rows[mode] = metric_rows(tmp_path / mode)
    assert len(rows["none"]) == 3 and rows["none"][-1]["val_loss"] > 0  # 2 steps, 1 eval
    assert rows["layer"] == [pytest.approx(row, rel=1e-6) for row in rows["none"]]


def test_bfloat16_autocast_trains_with_float32_master_weights(tmp_path, monkeypatch):
    rows, params = _first_loss_and_params(tmp_path, ["training.dtype='bfloat16'"])
    fp32_rows, _ = _first_loss_and_params(tmp_path / "fp32", ["training.dtype='float32'"])
    assert all(p.dtype == torch.float32 for p in params.values())
    assert abs(rows[0]["loss"] - fp32_rows[0]["loss"]) < 0.05 * fp32_rows[0]["loss"]
    assert rows[0]["loss"] != fp32_rows[0]["loss"]  # autocast really ran in bfloat16
    # where 'auto' resolves to bfloat16 (CUDA with bfloat16 arithmetic, a CPU with AMX tiles:
    # tests/train/test_memory.py), the step autocasts and the banner's peak is measured in it
    monkeypatch.setattr(TrainingConfig, "bfloat16_autocast", lambda self, device: True)
    peaks: list[torch.dtype] = []
    monkeypatch.setattr(
        throughput, "measure_peak_flops", lambda d, dtype: peaks.append(dtype) or 1e9
    )
    cast_rows, _ = _first_loss_and_params(tmp_path / "cast", ["training.dtype='auto'"])
    assert [r["loss"] for r in cast_rows] == [r["loss"] for r in rows]
    assert peaks == [torch.bfloat16]


def test_profile_numbers_go_to_the_metrics_stream(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "sample", lambda self, *args, **kwargs: None)  # not under test
    rows, _ = _first_loss_and_params(
        tmp_path, ["training.profile='detail'", "training.profile_memory=true"]
    )
    probes = [f"probe_{name}_s" for name in PROBES]
    for row in rows:
        parts = row["forward_s"] + row["backward_s"] + sum(row[p] for p in probes)
        assert 0 < parts < row["step_s"]  # the whole step also loads data and steps AdamW
        assert row["mem_before_mib"] > 0 and row["mem_after_backward_mib"] > 0
        assert "mem_before_reserved_mib" not in row  # a CUDA reading


def test_old_boolean_profile_setting_reads_as_step(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "sample", lambda self, *args, **kwargs: None)  # not under test
    rows, _ = _first_loss_and_params(tmp_path, ["training.profile=true"])
    assert rows[0]["forward_s"] > 0 and "probe_embed_s" not in rows[0]
    assert "mem_before_mib" not in rows[0]  # memory readings are training.profile_memory


def test_profiling_from_the_environment_leaves_training_bit_identical(tmp_path, monkeypatch):
    """Dropout on, two micro-steps per optimizer step: a run profiled in detail with memory
    readings (switched on by environment variables alone) ends with the same parameters, bit
    for bit, as the unprofiled run, and only it writes profile rows."""
    monkeypatch.setattr(Trainer, "sample", lambda self, *args, **kwargs: None)  # not under test
    overrides = [
        *MICRO,
        "training.max_steps=2",
        "training.eval_every=0",
        "training.checkpoint_every=0",
        "training.gradient_accumulation_steps=2",
    ]
    runs = {}
    for name, env in (
        ("plain", {}),
        ("profiled", {"BDH_PROFILE": "detail", "BDH_PROFILE_MEMORY": "1"}),
    ):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        trainer = Trainer(load_config(overrides=overrides), tmp_path / name, stream=io.StringIO())
        trainer.run()
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        runs[name] = (rows, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    (plain_rows, plain), (profiled_rows, profiled) = runs["plain"], runs["profiled"]
    assert not any("forward_s" in r for r in plain_rows)
    assert all(
        "probe_model_forward_backward_s" in r and "mem_after_forward_mib" in r
        for r in profiled_rows
    )
    assert [r["loss"] for r in plain_rows] == [r["loss"] for r in profiled_rows]
    for name, p in plain.items():
        assert torch.equal(p, profiled[name]), name


def test_init_from_loads_weights_only_and_honours_preserve_fresh(tmp_path):
    source = tmp_path / "source"
    Trainer(
        load_config(overrides=[*MICRO, "training.max_steps=2"]), source, stream=io.StringIO()
    ).run()
    trained = checkpoint_weights(source)
    overrides = [
        *MICRO,
        "training.max_steps=1",
        f"checkpoint.init_from='{source}'",
        "training.init_transfer.preserve_fresh_decoder=true",
    ]
    t = Trainer(load_config(overrides=overrides), tmp_path / "new", stream=io.StringIO())
    assert t.state.step == 0 and t.fresh_params == ["decoder"]
    weights = dict(t.model.named_parameters())
    assert torch.equal(weights["encoder"], trained["encoder"])
    assert not torch.equal(weights["decoder"], trained["decoder"])


def test_init_from_an_official_checkpoint(tmp_path):
    from helpers import official_frequencies_buffer

    path = tmp_path / "official.pt"
    g = torch.Generator().manual_seed(0)
    sd = {
        "decoder": torch.randn(128, 32, generator=g) * 0.02,
        "encoder": torch.randn(2, 32, 64, generator=g) * 0.02,
        "encoder_v": torch.randn(2, 32, 64, generator=g) * 0.02,
        "embed.weight": torch.randn(256, 32, generator=g) * 0.02,
        "lm_head": torch.randn(32, 256, generator=g) * 0.02,
        "attn.freqs": official_frequencies_buffer(64),
    }
    torch.save(sd, path)
    overrides = [*MICRO, f"checkpoint.init_from='{path}'"]
    t = Trainer(load_config(overrides=overrides), tmp_path / "run", stream=io.StringIO())
    assert torch.equal(t.model.encoder.detach(), sd["encoder"])
    assert t.fresh_params == []


def test_backbone_freeze_counts_optimizer_steps_under_accumulation(tmp_path, monkeypatch):
    """backbone_grad_scale = 0 for 2 steps with 3 micro-batches per step: the backbone is
    unchanged after optimizer steps 1 and 2 and moves at step 3, while the interface surface
    trains from step 1. (Counting micro-batches, as the reference's per-call counter does,
    would unfreeze it during step 1.) Weight decay is off: AdamW's decoupled decay would
    shrink frozen matrices too."""
    monkeypatch.setattr(Trainer, "sample", lambda self, *args, **kwargs: None)  # not under test
    overrides = [
        *MICRO,
        "training.max_steps=3",
        "training.gradient_accumulation_steps=3",
        "training.eval_every=0",
        "training.checkpoint_every=0",
        "training.init_transfer.backbone_grad_scale=0.0",
        "training.init_transfer.backbone_grad_scale_steps=2",
        "optimizer.weight_decay=0.0",
    ]
    trainer = Trainer(load_config(overrides=overrides), tmp_path, stream=io.StringIO())
    backbone = transferred_backbone_params(trainer.model)
    surface = interface_surface_params(trainer.model)
    assert sorted(backbone) == ["decoder", "encoder", "encoder_v"]
    snapshots = [{n: p.detach().clone() for n, p in trainer.model.named_parameters()}]
    real_step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        snapshots.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        return result

    trainer.optimizer.step = recording_step
    trainer.run()
    assert len(snapshots) == 4 and trainer.state.step == 3
    for step in (1, 2):
        for name in backbone:
            assert torch.equal(snapshots[step][name], snapshots[0][name]), (step, name)
        for name in surface:
            assert not torch.equal(snapshots[step][name], snapshots[step - 1][name]), (step, name)
    for name in backbone:
        assert not torch.equal(snapshots[3][name], snapshots[2][name]), name


def test_init_from_with_a_mismatched_backbone_is_refused(tmp_path):
    from bdh_train.errors import CheckpointError

    source = tmp_path / "source"
    Trainer(
        load_config(overrides=[*MICRO, "training.max_steps=1"]), source, stream=io.StringIO()
    ).run()
    overrides = [*MICRO, "model.mlp_internal_dim_multiplier=8", f"checkpoint.init_from='{source}'"]
    with pytest.raises(
        CheckpointError,
        match=r"backbone parameter encoder has shape \[2, 32, 64\], the model needs \[2, 32, 128\]",
    ):
        Trainer(load_config(overrides=overrides), tmp_path / "new")


FIXTURE_V0_1 = Path(__file__).parents[1] / "fixtures" / "checkpoint_v0_1"


def test_checkpoint_written_by_v0_1_resumes_to_v0_1s_metrics(tmp_path, capsys):
    """A mid-window streaming-TBPTT checkpoint written by v0.1 (before the components owned
    their configs, see fixtures/checkpoint_v0_1/make_fixture.py.txt) resumes and ends with
    v0.1's uninterrupted run's metrics: step, tokens and lr exactly, loss and grad norm to
    float32's 1e-5. Those were recorded on another machine, whose BLAS may round a product
    differently (MKL on an Intel Xeon and on an AMD EPYC gave grad norms 1e-7 apart); that a
    resume on one machine is bit-exact is test_resume_is_bit_exact's."""
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(FIXTURE_V0_1, run)
    cfg = load_config([run / "config.toml"], default_preset=False)  # a complete saved config
    assert "module_lr_scales is deprecated" in capsys.readouterr().err
    trainer = Trainer(cfg, run, resume=True, stream=io.StringIO())
    assert (trainer.state.step, trainer.state.micro) == (4, 1)
    trainer.run()
    expected = json.loads((FIXTURE_V0_1 / "expected_metrics.json").read_text())
    got = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["tokens"], r["lr"]) for r in got] == [
        (r["step"], r["tokens"], r["lr"]) for r in expected
    ]
    for name in ("loss", "grad_norm"):
        assert [r[name] for r in got] == pytest.approx([r[name] for r in expected], rel=1e-5)


def test_optimizer_steps_with_the_scheduled_lr_of_that_step_and_logs_it(tmp_path, monkeypatch):
    """param_groups' lr at the moment of optimizer.step() and the logged lr are the schedule's
    value for the step being taken (index = steps already taken), not the next one's."""
    monkeypatch.setattr(Trainer, "sample", lambda self, *args, **kwargs: None)  # not under test
    base, floor = 2.0**-8, 2.0**-10
    overrides = [
        *MICRO,
        "training.max_steps=5",
        "training.gradient_accumulation_steps=2",
        "training.eval_every=0",
        "training.checkpoint_every=0",
        f"optimizer.lr={base}",
        "optimizer.warmup_steps=2",
        "optimizer.schedule='cosine'",
        f"optimizer.min_lr={floor}",
    ]
    trainer = Trainer(load_config(overrides=overrides), tmp_path, stream=io.StringIO())
    used: list[list[float]] = []
    real_step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        used.append([group["lr"] for group in trainer.optimizer.param_groups])
        return real_step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.run()
    # By hand: warm-up 2 -> base/2, base; then cosine over 5 - 2 = 3 intervals starting at
    # index 2: progress 0, 1/3, 2/3 -> base, floor + (base-floor)(1 + cos(pi/3))/2 = 3/4 of
    # the way, floor + (base-floor)(1 + cos(2pi/3))/2 = 1/4 of the way.
    expected = [
        base / 2,
        base,
        base,
        floor + 0.75 * (base - floor),
        floor + 0.25 * (base - floor),
    ]
    assert len(used) == 5, f"optimizer.step ran {len(used)} times for 5 steps"
    for index, (groups, want) in enumerate(zip(used, expected, strict=True)):
        for lr in groups:
            assert lr == pytest.approx(want, rel=1e-12, abs=0), (
                f"optimizer step {index + 1} ran with lr {lr}, schedule says {want}"
            )
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["lr"] for r in rows] == [groups[0] for groups in used]


def test_keep_checkpoints_keeps_exactly_the_newest_k(tmp_path, monkeypatch):
    """keep_checkpoints=2 with a checkpoint every step, a mid-window stop and a resume: after
    every save exactly the two newest checkpoints are on disk, in step order."""
    overrides = [
        *MICRO,
        "training.max_steps=5",
        "training.gradient_accumulation_steps=2",
        "training.eval_every=0",
        "training.checkpoint_every=1",
        "training.keep_checkpoints=2",
    ]
    monkeypatch.setattr(Trainer, "sample", lambda self, *args, **kwargs: None)  # not under test
    listings: list[list[str]] = []
    real_save = ckpt.save_checkpoint

    def recording_save(*args, **kwargs):
        path = real_save(*args, **kwargs)
        listings.append(sorted(p.name for p in path.parent.iterdir() if p.name != ckpt.LATEST))
        return path

    monkeypatch.setattr(ckpt, "save_checkpoint", recording_save)
    first = Trainer(load_config(overrides=overrides), tmp_path, stream=io.StringIO())
    first.run(stop_after_micro_steps=7)  # steps 1-3, then stop one micro-step into step 4
    Trainer(load_config(overrides=overrides), tmp_path, resume=True, stream=io.StringIO()).run()
    assert listings == [
        ["step-0000001"],
        ["step-0000001", "step-0000002"],
        ["step-0000002", "step-0000003"],
        ["step-0000003", "step-0000003-m01"],
        ["step-0000003-m01", "step-0000004"],
        ["step-0000004", "step-0000005"],
    ]
    assert ckpt.resolve_checkpoint(tmp_path).name == "step-0000005"


def test_trainer_sample_generates_without_dropout(tmp_path):
    noisy = Trainer(
        load_config(overrides=[*MICRO, "model.dropout=0.5"]), tmp_path / "a", stream=io.StringIO()
    )
    clean = Trainer(
        load_config(overrides=[*MICRO, "model.dropout=0.0"]), tmp_path / "b", stream=io.StringIO()
    )
    clean.model.load_state_dict(noisy.model.state_dict())
    assert noisy.model.training
    first = noisy.sample(24)
    assert noisy.model.training, "sample() must give the model back in train mode"
    assert first == noisy.sample(24), "two samples from the same weights and seed differ"
    assert first == clean.sample(24), "the sample differs from the dropout-free model's"


def test_optimizer_defaults_of_a_file_without_preset_reach_adamw_and_clipping(
    tmp_path, monkeypatch
):
    """A file read with no base preset and no [optimizer] (a file without `extends` read the
    normal way sits on the tiny preset, see test_config): AdamW(lr 1e-3, betas (0.9, 0.95),
    eps 1e-8, weight decay 0.1 on matrices), a constant lr without warm-up, and the gradient
    norm clipped at 1.0."""
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent("""
            [model]
            n_layer = 2
            n_embd = 32
            n_head = 2
            mlp_internal_dim_multiplier = 4
            [training]
            block_size = 16
            batch_size = 4
            max_steps = 3
            log_every = 1
            eval_every = 0
            checkpoint_every = 0
        """)
    )
    clip_norms: list[float] = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(parameters, max_norm, *args, **kwargs):
        clip_norms.append(max_norm)
        return real_clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    cfg = load_config([config], default_preset=False)
    trainer = Trainer(cfg, tmp_path / "run", stream=io.StringIO())
    monkeypatch.setattr(trainer, "sample", lambda *args, **kwargs: None)  # not under test
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    for group in trainer.optimizer.param_groups:
        assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-8
        dims = {p.dim() for p in group["params"]}
        assert group["weight_decay"] == (0.1 if min(dims) >= 2 else 0.0), dims
    trainer.run()
    assert clip_norms == [1.0, 1.0, 1.0]
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["lr"] for r in rows] == [1e-3, 1e-3, 1e-3]


# ------------------------------------------------------------------ one trainer per run dir
def test_a_fresh_run_refuses_a_directory_holding_another_run(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(overrides=[*MICRO, "training.max_steps=2"])
    Trainer(cfg, run, stream=io.StringIO()).run()
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(ConfigError, match="already holds a run .*--resume .*--overwrite"):
        Trainer(load_config(overrides=MICRO), run, stream=io.StringIO())
    assert sorted(p.name for p in run.iterdir()) == before
    fresh = Trainer(
        load_config(overrides=[*MICRO, "training.max_steps=1"]),
        run,
        stream=io.StringIO(),
        overwrite=True,
    )
    fresh.run()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1]
    assert ckpt.resolve_checkpoint(run).name == "step-0000001"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-0000001"]


@pytest.mark.timeout(120)  # a second trainer that the lock let through trains 100000 steps
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "term"])
def test_a_second_trainer_is_refused_and_a_signal_stops_the_first_cleanly(
    tmp_path, stop_signal, capsys
):
    """The first trainer (`bdh-train train` in a process of its own) holds the run
    directory's lock; a second (a resume of the same run with another lr, in this process)
    gets one error line naming the holder's pid and changes nothing. Ctrl-C or SIGTERM then
    stops the first at the next micro-step with a checkpoint of exactly the step it reached,
    and exit status 75 (stopped, resumable) instead of 0 (finished)."""
    run = tmp_path / "run"
    overrides = [*MICRO, "training.eval_every=0", "training.max_steps=100000"]
    argv = ["train", "--run-dir", str(run), *[f"--set={o}" for o in overrides]]
    with start_process(cli_main, argv, stdout=tmp_path / "first.out") as first:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "latest").exists():
            assert first.is_alive() and time.monotonic() < deadline, "first run did not start"
            time.sleep(0.05)
        if stop_signal == signal.SIGTERM:  # the lock refuses a second trainer (once is enough)
            capsys.readouterr()
            assert main(["train", "--resume", str(run), "--set=optimizer.lr=0.5"]) == 2
            assert capsys.readouterr().err.strip().splitlines() == [
                f"error: run directory {run} is in use by another trainer (pid {first.pid}); "
                "wait for it to finish or stop it, or use another --run-dir"
            ]
        assert first.pid is not None
        os.kill(first.pid, stop_signal)
        first.join(timeout=120)
        assert first.exitcode == 75, (tmp_path / "first.out").read_text()[-2000:]
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, len(steps) + 1)), "the first run's log was disturbed"
    assert load_config([run / "config.toml"]).optimizer.lr != 0.5
    stopped = ckpt.resolve_checkpoint(run)
    assert ckpt.read_json(stopped / "trainer.json")["step"] == steps[-1]


def test_a_second_trainer_is_refused_before_it_touches_the_run(tmp_path):
    """Building a trainer finishes or undoes interrupted checkpoint saves, which removes
    temporary checkpoint directories: a second trainer built while the first one holds the
    run (and may be half-way through a save) must be refused before that, leaving the first
    one's temporary directory alone."""
    run = tmp_path / "run"
    Trainer(
        load_config(overrides=[*MICRO, "training.max_steps=5"]), run, stream=io.StringIO()
    ).run()
    overrides = [*MICRO, "training.max_steps=6"]
    holder = Trainer(load_config(overrides=overrides), run, resume=True, stream=io.StringIO())
    saving = run / "checkpoints" / ".tmp-step-0000006-abc"  # the holder's save in progress
    saving.mkdir()
    with pytest.raises(ConfigError, match="in use by another trainer"):
        Trainer(load_config(overrides=overrides), run, resume=True, stream=io.StringIO())
    assert saving.is_dir()
    holder.close()  # a trainer that will not run lets the run go
    Trainer(load_config(overrides=overrides), run, resume=True, stream=io.StringIO()).run()
    assert not saving.exists()  # the next trainer to own the run cleans the leftover up


def test_resume_drops_a_torn_metrics_line_with_a_notice(tmp_path):
    overrides = [*MICRO, "training.max_steps=4"]
    run = tmp_path / "run"
    Trainer(load_config(overrides=overrides), run, stream=io.StringIO()).run(
        stop_after_micro_steps=2
    )
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "tokens": 19')  # a write cut short by a full disk
    log = io.StringIO()
    Trainer(load_config(overrides=overrides), run, resume=True, stream=log).run()
    assert "the last line of" in log.getvalue() and "was torn" in log.getvalue()
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_the_trainer_module_only_assembles_and_loops():
    """training/trainer.py builds the components and runs the loop; what is neither (the
    banner's fields, the evaluation recipe, the state-gain measure) lives in the component
    that owns it, which keeps the module under 400 lines."""
    from bdh_train.training import trainer

    lines = Path(trainer.__file__).read_text(encoding="utf-8").count("\n")
    assert lines < 400, f"training/trainer.py has {lines} lines"


# Where a run directory is replaced while its trainer runs: after which call of which
# method (a 4-step run, a checkpoint every step), and what the trainer would write next.
REPLACED_DURING = {
    "a step": (StepWindow, "optimizer_step", 2),  # next: step 2's metrics row
    "an evaluation": (Evaluator, "run", 1),  # next: its row (evaluating every 2 steps)
    "a step's row": (MetricsReporter, "log_step", 2),  # next: step 2's checkpoint
    "the last checkpoint": (TrainingCheckpoints, "save", 4),  # next: the loss plot
}


@pytest.mark.parametrize(
    ("how", "during"),
    [
        ("moved", "a step"),
        ("deleted", "an evaluation"),
        ("moved", "a step's row"),
        pytest.param("deleted", "the last checkpoint", marks=pytest.mark.loss_plot),
    ],
)
def test_a_trainer_whose_run_directory_was_replaced_stops_without_writing_into_the_new_run(
    tmp_path, monkeypatch, capsys, how, during
):
    """The run directory of a running trainer is moved away (or deleted) and another run is
    started at its path: after step 2 (or its evaluation, or its metrics row, or the last
    checkpoint). The first trainer then stops before its next write, with one error line
    saying where its run went, and leaves the new run byte for byte as it was (no metrics
    row, checkpoint, `latest`, plot or error log of its own there). A moved run resumes from
    where it now lies."""
    run, moved = tmp_path / "run", tmp_path / "moved"
    overrides = [*MICRO, "training.max_steps=4", "training.checkpoint_every=1"]
    evaluate = "training.eval_every=" + ("2" if during == "an evaluation" else "0")
    sets = [f"--set={o}" for o in [*overrides, evaluate]]
    owner, name, nth = REPLACED_DURING[during]
    original = getattr(owner, name)
    held: list[RunDirLock] = []
    calls: list[int] = []

    def then_replace(self, *args):
        out = original(self, *args)
        calls.append(1)
        if len(calls) == nth:
            if how == "moved":
                run.rename(moved)
            else:
                shutil.rmtree(run)
            held.append(RunDirLock(run).acquire())  # another trainer owns the path now
            (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
        return out

    monkeypatch.setattr(owner, name, then_replace)
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), *sets]) == 2
    new_run = {p.name: p.read_bytes() for p in run.iterdir()}
    assert sorted(new_run) == [".lock", "metrics.jsonl"]
    assert new_run["metrics.jsonl"] == b'{"step": 1, "loss": 9.0}\n'
    went = (
        f"it was moved to {moved}: continue it there with bdh-train train --resume {moved}"
        if how == "moved"
        else "its lock file was deleted, with the directory or alone"
    )
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: run directory {run} is no longer this trainer's ({run / '.lock'} is not the "
        f"lock it holds): {went}; stopped without writing to {run} again, so what is there "
        "now is left as it is"
    ]
    held[0].release()
    if how == "moved":  # the moved run resumes from its last checkpoint, before step 2's
        monkeypatch.setattr(owner, name, original)
        assert ckpt.resolve_checkpoint(moved).name == "step-0000001"
        rows = [r["step"] for r in read_metrics(moved / "metrics.jsonl") if "loss" in r]
        assert rows == ([1, 2] if during == "a step's row" else [1])
        assert main(["train", "--resume", str(moved)]) == 0
        steps = [r["step"] for r in read_metrics(moved / "metrics.jsonl") if "loss" in r]
        assert steps == [1, 2, 3, 4]


def test_a_trainer_built_on_a_directory_that_was_replaced_before_it_ran_writes_nothing(tmp_path):
    """Between building a trainer (which takes the lock) and running it, its directory is
    deleted and another run takes the path: `run` stops before its first write (the config,
    the metrics) and the new run keeps only what it had."""
    run = tmp_path / "run"
    trainer = Trainer(load_config(overrides=MICRO), run, stream=io.StringIO())
    shutil.rmtree(run)
    other = RunDirLock(run).acquire()
    deleted = "its lock file was deleted, with the directory or alone; stopped without writing"
    with pytest.raises(RunDirLost, match=deleted):
        trainer.run()
    assert trainer.run_files.lost()  # also once the lock is let go: by the lock file it claimed
    assert [p.name for p in run.iterdir()] == [".lock"]
    other.release()
