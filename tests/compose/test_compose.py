"""`bdh-train grow` and `bdh-train merge` on runs (bdh_train.compose): the output trains on
and resumes bit-exactly, a merge reports every domain, refusals write nothing, and a frozen
group stays bit-identical through a fine-tune with weight decay."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from helpers import MICRO_RUN, assert_close, checkpoint_weights, metric_rows
from safetensors import safe_open
from safetensors.torch import save_file

from bdh_train.cli import main
from bdh_train.compose.common import Source, write_composed
from bdh_train.compose.merge import FinetuneConfig, finetune_model
from bdh_train.config import load_config
from bdh_train.data.tokens import TokenData
from bdh_train.model import BDH
from bdh_train.model.sampling import NonFiniteModelError
from bdh_train.shared.loading import load_run
from bdh_train.storage import checkpoint as ckpt
from bdh_train.train.config import TrainingConfig
from bdh_train.train.optim import OptimizerConfig
from bdh_train.training.trainer import Trainer, TrainingDiverged
from bdh_train.utils import STEPS_CAP_ENV

SHORT = [
    *MICRO_RUN,
    "model.position='rope'",  # a grown model's rope table is checked against its sources'
    "training.max_steps=2",
    "training.eval_every=0",
    "training.eval_steps=1",
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Two short runs of the same shape on different text (pydoc and a generated file), and
    an untrained model of another width written as a checkpoint directory."""
    root = tmp_path_factory.mktemp("sources")
    text = root / "text.txt"
    text.write_text("".join(f"line {i}: the cat sat on mat {i * 7}\n" for i in range(400)))
    runs = {"A": SHORT, "B": [*SHORT, f"data.source='{text}'", "training.seed=7"]}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "sample", lambda self, *args, **kwargs: None)  # not under test
        for name, overrides in runs.items():
            Trainer(load_config(overrides=overrides), root / name, stream=io.StringIO()).run()
    cfg = load_config(overrides=[*SHORT, "model.n_embd=64"])
    write_composed(root / "wide", BDH(cfg.model), Source("wide", BDH(cfg.model), None, cfg))
    return {name: root / name for name in ("A", "B", "wide")}


def test_a_grown_run_computes_the_same_then_trains_and_resumes_bit_exactly(
    sources, tmp_path, monkeypatch
):
    monkeypatch.setattr(Trainer, "sample", lambda self, *args, **kwargs: None)
    grown = tmp_path / "grown"
    assert main(["grow", "--checkpoint", str(sources["A"]), "--neurons-multiplier", "2",
                 "--out", str(grown)]) == 0  # fmt: skip
    old, _, _ = load_run(sources["A"])
    new, _, _ = load_run(grown)
    assert new.config.n_neurons == 2 * old.config.n_neurons
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    assert_close(new(idx)[0], old(idx)[0], rtol=1e-6)

    overrides = ["training.max_steps=3", "training.checkpoint_every=0", "training.log_every=1"]

    def config():
        return load_config([grown / "config.toml"], overrides, default_preset=False)

    # the fine-tune recipe: the lr the source ended at, its 2nd step of 20 warming up to
    # 3e-3: 3e-3 * 2 / 20, constant after 10 warm-up steps (not the source's 3e-3 again)
    recipe = config().optimizer
    assert (recipe.lr, recipe.schedule, recipe.warmup_steps) == (3e-4, "constant", 10)
    # the sources trained 2 steps: the grown model learns visibly in 3 at the sources' rate
    overrides += ["optimizer.lr=3e-3", "optimizer.warmup_steps=0"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    banner = io.StringIO()
    Trainer(config(), whole, stream=banner).run()
    assert f"weights        loaded from {grown.resolve()}" in banner.getvalue().splitlines()
    assert Trainer(config(), split, stream=io.StringIO()).run(1).stopped_early
    Trainer(config(), split, resume=True, stream=io.StringIO()).run()
    a, b = checkpoint_weights(whole), checkpoint_weights(split)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert metric_rows(whole) == metric_rows(split)
    losses = [row["loss"] for row in metric_rows(whole) if "loss" in row]
    assert losses[-1] < losses[0], losses
    assert torch.equal(a["rope_freqs"], old.rope_freqs.repeat(2))  # a buffer: never trained
    n = old.config.n_neurons
    new_rows = a["decoder"].view(old.config.n_head, 2 * n, -1)[:, n:]
    assert new_rows.abs().max() > 0  # the new neurons learn


def test_merge_reports_every_domain_and_fine_tunes_with_the_embedding_frozen(
    sources, tmp_path, capsys
):
    out = tmp_path / "merged"
    argv = ["merge", str(sources["A"]), str(sources["B"]), "--out", str(out)]
    argv += ["--finetune-steps", "3", "--freeze", "embedding", "--eval-batches", "1"]
    assert main(argv) == 0
    printed, shown = capsys.readouterr()
    for model in ("A", "B", "merged", "merged+ft3"):
        assert f"{model} " in printed, printed
    assert printed.splitlines()[-1] == (
        "its config trains on with a fine-tune recipe: lr 0.0003 (constant) after 10 warm-up steps"
    )
    # on stderr as it works: each of the 4 models x 2 domains evaluated, with the count and
    # an ETA, and the fine-tune's steps as train prints them
    evaluated = [line for line in shown.splitlines() if line.startswith("evaluated ")]
    assert [line.split(": val_loss ")[0] for line in evaluated] == [
        f"evaluated {m} on domain {d}" for m in ("A", "B", "merged", "merged+ft3") for d in "AB"
    ]
    assert [line.split(" (")[1].split(", ETA ")[0] for line in evaluated] == [
        f"{i}/8 evaluations" for i in range(1, 9)
    ]
    steps = [line for line in shown.splitlines() if line.startswith("step ")]
    assert steps[0].startswith("step 1/3 | loss ") and " | ETA " in steps[0]
    assert steps[-1].startswith("step 3/3 | loss ") and " | 192 tok | " in steps[-1]
    # the sources' lr, 3e-3, after a linear warm-up of 10 steps: 3e-4 at step 1, 9e-4 at 3
    assert " | lr 3.00e-04 | " in steps[0] and " | lr 9.00e-04 | " in steps[-1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [1, 2, 3]
    table = {(r["model"], r["domain"]): r for r in rows if "domain" in r}
    assert set(table) == {(m, d) for m in ("A", "B", "merged", "merged+ft3") for d in "AB"}
    assert all("bits_per_byte" in r and "val_loss" in r for r in table.values())
    a, b = checkpoint_weights(sources["A"]), checkpoint_weights(sources["B"])
    merged = checkpoint_weights(out)
    average = ((a["embed.weight"].double() + b["embed.weight"].double()) / 2).float()
    assert torch.equal(merged["embed.weight"], average)  # frozen through the fine-tune
    assert not torch.equal(merged["lm_head"], ((a["lm_head"] + b["lm_head"]) / 2))


def test_the_steps_cap_shortens_a_merges_fine_tune(sources, tmp_path, monkeypatch, capsys):
    """BDH_TRAIN_MAX_STEPS=2 (a smoke test, as the README's test runs it): 2 steps, not 5."""
    monkeypatch.setenv(STEPS_CAP_ENV, "2")
    out = tmp_path / "capped"
    argv = ["merge", str(sources["A"]), str(sources["B"]), "--out", str(out)]
    assert main([*argv, "--finetune-steps", "5", "--eval-batches", "1"]) == 0
    assert "merged+ft2 " in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [1, 2]


def test_a_refused_merge_or_grow_is_one_line_and_writes_nothing(sources, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["merge", str(sources["A"]), str(sources["wide"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot merge B") and "model.n_embd differs" in err
    assert err.count("\n") == 1
    out.mkdir()
    argv = ["grow", "--checkpoint", str(sources["A"]), "--neurons-multiplier", "2"]
    assert main([*argv, "--out", str(out)]) == 2
    assert "exists: choose a new path" in capsys.readouterr().err
    assert main([*argv[:-1], "1", "--out", str(tmp_path / "new")]) == 2
    assert "--neurons-multiplier must be an integer >= 2" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not any(out.iterdir())


def test_a_source_with_nan_weights_is_refused_and_nothing_is_written(sources, tmp_path, capsys):
    """A merge or grow of NaN weights is NaN: refused with one line naming the source and
    the tensor, before anything is written."""
    bad = tmp_path / "nan"
    model, _, cfg = load_run(sources["B"])
    with torch.no_grad():
        model.encoder.view(-1)[3] = float("nan")
    count = model.encoder.numel()
    with pytest.raises(NonFiniteModelError, match="a fine-tune diverged"):  # nor written
        write_composed(bad, model, Source(str(bad), model, None, cfg))
    assert not bad.exists()
    source = ckpt.resolve_checkpoint(sources["B"]) / ckpt.MODEL_FILE
    with safe_open(str(source), "pt") as handle:
        meta = handle.metadata()
    bad.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(bad / ckpt.MODEL_FILE), metadata=meta)  # fmt: skip
    ckpt.write_manifest(bad)
    commands = {
        "grow": ["grow", "--checkpoint", str(bad), "--neurons-multiplier", "2"],
        "merge": ["merge", str(sources["A"]), str(bad)],
    }
    for name, argv in commands.items():
        capsys.readouterr()
        assert main([*argv, "--out", str(tmp_path / name)]) == 2
        assert capsys.readouterr().err == (
            f"error: the weights of the source {bad} are not finite: NaN or infinity in encoder "
            f"(1 of {count:,} values); nothing was written: pass a checkpoint whose weights "
            "are finite\n"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan"]


def test_a_frozen_group_gets_neither_gradient_nor_weight_decay():
    """Five AdamW steps with a large weight decay (0.5, lr 0.05): the frozen embedding is
    bit-identical, every other matrix moved (a frozen tensor left in the optimizer with a
    masked gradient would shrink by lr * decay a step)."""
    torch.manual_seed(0)
    model = BDH(load_config(overrides=MICRO_RUN).model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(1))
    data = [TokenData(tokens.numpy(), 256, "random")]
    adamw = OptimizerConfig(lr=0.05, weight_decay=0.5)
    frozen = FinetuneConfig(5, freeze=["embedding"])
    losses = finetune_model(model, data, frozen, adamw, TrainingConfig(block_size=16, batch_size=4))
    assert len(losses) == 5
    after = model.state_dict()
    assert torch.equal(after["embed.weight"], before["embed.weight"])
    for name in ("encoder", "encoder_v", "decoder", "lm_head"):
        assert not torch.equal(after[name], before[name]), name
    assert all(p.requires_grad for p in model.parameters())  # unfrozen afterwards


def test_a_fine_tune_skips_non_finite_steps_as_training_does():
    """A NaN weight makes every loss NaN: each step is skipped (the weights stay as they
    were), and the sixth in a row (training.max_consecutive_skips = 5) stops the fine-tune
    with training's message, saying that nothing was written."""
    torch.manual_seed(0)
    model = BDH(load_config(overrides=MICRO_RUN).model)
    with torch.no_grad():
        model.lm_head.view(-1)[0] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(1))
    data = [TokenData(tokens.numpy(), 256, "random")]
    training = TrainingConfig(block_size=16, batch_size=4)
    with pytest.raises(TrainingDiverged, match=r"^6 consecutive steps .* nothing was written"):
        finetune_model(model, data, FinetuneConfig(9), OptimizerConfig(), training)
    torch.testing.assert_close(dict(model.state_dict()), before, rtol=0, atol=0, equal_nan=True)
