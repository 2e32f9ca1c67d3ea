"""benchmarks/recipe.py: the GPT baseline's parameter count against its formula, the
held-out losses (windows, sliding window, stream) and the time-based schedule against hand
computations, a streamed arm's carried state, and a whole run at a budget of one step per
arm on a micro model."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import FRESH_BLOCKS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import recipe  # noqa: E402

from bdh_train.train import config as training_config  # noqa: E402
from bdh_train.train.optim import OptimizerConfig  # noqa: E402

MICRO = [
    "model.n_layer=1",
    "model.n_embd=16",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=4",
    "training.block_size=16",
    "training.batch_size=2",
]


@pytest.mark.parametrize(("vocab", "layers", "dim", "heads"), [(256, 1, 16, 2), (32, 3, 24, 4)])
def test_gpt_parameter_count_matches_its_formula(vocab, layers, dim, heads):
    model = recipe.GPT(vocab, layers, dim, heads, dropout=0.0)
    assert sum(p.numel() for p in model.parameters()) == recipe.gpt_parameter_count(
        vocab, layers, dim
    )


def test_gpt_width_nearest_a_bdh_of_851968_parameters():
    """A BDH of L4 D128 H4 N512 has 851,968 parameters (3 * H * D * N + 2 * V * D); with 4
    layers the nearest GPT is D=128: 2*256*128 + 4*(12*128^2 + 4*128) + 2*128 = 854,272."""
    bdh = 3 * 4 * 128 * 512 + 2 * 256 * 128
    assert bdh == 851_968
    assert recipe.gpt_width(256, 4, 4, bdh) == 128
    assert recipe.gpt_parameter_count(256, 4, 128) == 854_272


class MeanTarget(torch.nn.Module):
    """A 'model' whose loss is the mean of its targets: the held-out mean is then theirs."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x, y):
        return None, y.double().mean()


def test_held_out_loss_weights_every_target_of_the_windows_once():
    held = torch.arange(100) % 7
    # windows of 10 + 1 bytes start at 0, 10, ..., 80 (a start must leave 11 bytes within
    # the 95 read); the targets are held[1:91]
    got = recipe.held_out_loss(MeanTarget(), held, context=10, max_bytes=95)
    assert got == pytest.approx(float(held[1:91].double().mean()), abs=1e-12)


class ContextLength(torch.nn.Module):
    """A 'model' of two ids whose loss on target 0 at position j of a window is
    softplus(-j) = -log sigmoid(j): it grows the less context the target is read with."""

    def forward(self, x, y):
        logits = torch.zeros(*x.shape, 2, dtype=torch.float64)
        logits[..., 0] = torch.arange(x.shape[1], dtype=torch.float64)
        return logits, None


def test_sliding_loss_reads_each_target_once_with_its_window_of_context():
    """Window 4, stride 2, 11 bytes of zeros (targets 1..10): the first window scores
    targets 1-4 at positions 0-3, then windows starting at 2, 4, 6 score targets 5-6, 7-8
    and 9-10 at positions 2-3 (3-4 bytes of context)."""
    sp = [math.log1p(math.exp(-j)) for j in range(4)]
    expected = (sum(sp) + 3 * (sp[2] + sp[3])) / 10
    got = recipe.sliding_loss(ContextLength(), torch.zeros(20, dtype=torch.long), 4, 2, 11)
    assert got == pytest.approx(expected, abs=1e-12)
    # stride = window: targets 1-4 and 5-8 at positions 0-3, then the last two targets (9-10)
    # from the window starting at 6, at positions 2-3
    got = recipe.sliding_loss(ContextLength(), torch.zeros(20, dtype=torch.long), 4, 4, 11)
    assert got == pytest.approx((2 * sum(sp) + sp[2] + sp[3]) / 10, abs=1e-12)
    with pytest.raises(ValueError, match="stride"):
        recipe.sliding_loss(ContextLength(), torch.zeros(20, dtype=torch.long), 4, 5, 11)
    with pytest.raises(ValueError, match="needs 5"):
        recipe.sliding_loss(ContextLength(), torch.zeros(20, dtype=torch.long), 4, 2, 4)


def test_stream_loss_is_the_whole_text_read_at_once():
    """The stream read chunk by chunk with the state carried (2,500 tokens: three calls of
    at most PREFILL_TOKENS) equals one forward over the whole text from a fresh state (fp32,
    1e-5): the mean loss of every target."""
    from bdh_train.config import load_config
    from bdh_train.model.bdh import BDH
    from bdh_train.model.sampling import PREFILL_TOKENS

    assert PREFILL_TOKENS < 1250
    torch.manual_seed(0)
    model = BDH(load_config([], [*MICRO, "model.position=alibi"], preset="tiny").model)
    held = torch.randint(0, 256, (2500,))
    _, loss = model(held[None, :-1], held[None, 1:])
    got = recipe.stream_loss(model, torch.cat([held, held]), max_bytes=2500)
    assert got == pytest.approx(float(loss.detach()), rel=1e-5)


def test_a_streamed_arm_carries_its_state_through_consecutive_blocks(tmp_path):
    """A BDH arm whose config streams trains through the trainer's streaming loader and step:
    after two steps each row has read two consecutive blocks of its document and the
    carried state is the second block's."""
    streamed = ["training.tbptt_persist_across_steps=true", "training.min_logical_block_size=64"]
    arm = recipe.bdh_arm(recipe.Recipe("tiny", tuple(MICRO)), "adamw", streamed, 10.0, "s")
    assert isinstance(arm, recipe.StreamedArm) and arm.logical_length == 64
    train = torch.arange(1000) % 256
    arm.prime(train)
    arm.step(train)
    arm.step(train)
    assert arm.steps == 2 and len(arm.losses) == 2
    assert arm.loader is not None and arm.loader.row_next == [2, 2]
    assert arm.executor is not None and arm.executor.carried_state is not None
    fresh = recipe.Recipe("tiny", (*MICRO, *FRESH_BLOCKS))
    assert type(recipe.bdh_arm(fresh, "adamw", [], 10.0, "p")) is recipe.Arm


def test_arm_learning_rate_warms_up_over_steps_then_follows_the_clock():
    optim = OptimizerConfig(lr=0.01, min_lr=0.001, warmup_steps=4, schedule="cosine")
    arm = recipe.Arm("x", "x", torch.nn.Linear(1, 1), None, optim, 4, 2, 100.0, 0)  # type: ignore[arg-type]
    assert arm.lr() == pytest.approx(0.0025)  # step 0 of a 4-step warm-up
    arm.steps, arm.elapsed = 4, 25.0  # a quarter of the budget: cos(pi / 4)
    assert arm.lr() == pytest.approx(0.001 + 0.009 * (1 + math.sqrt(0.5)) / 2, rel=1e-12)
    arm.elapsed = 100.0
    assert arm.lr() == pytest.approx(0.001, rel=1e-12)


def test_arm_with_total_steps_schedules_and_stops_by_steps():
    optim = OptimizerConfig(lr=0.01, min_lr=0.001, warmup_steps=4, schedule="cosine")
    arm = recipe.Arm("x", "x", torch.nn.Linear(1, 1), None, optim, 4, 2, 100.0, 0, 8)  # type: ignore[arg-type]
    arm.steps, arm.elapsed = 6, 1000.0  # 6 of 8 steps: cos(3 pi / 4), whatever the clock
    assert arm.lr() == pytest.approx(0.001 + 0.009 * (1 - math.sqrt(0.5)) / 2, rel=1e-12)
    assert not arm.done
    arm.steps, arm.elapsed = 8, 0.0
    assert arm.done and arm.lr() == pytest.approx(0.001, rel=1e-12)


@pytest.fixture
def text_for_main(tmp_path, monkeypatch) -> Path:
    """A 1,900-byte text file for a whole `recipe.main` run; the process-wide settings the
    script makes (allocator, threads) are left as the test process has them."""
    monkeypatch.setattr(recipe, "configure_host_allocator", lambda mode, device: "system")
    monkeypatch.setattr(recipe.torch, "set_num_threads", lambda threads: None)
    data = tmp_path / "text.txt"
    data.write_bytes(bytes(range(32, 127)) * 20)
    return data


def test_recipe_runs_one_step_per_arm_and_prints_the_table(text_for_main, capsys, monkeypatch):
    data = text_for_main
    raced: list[recipe.Arm] = []
    race = recipe.race
    monkeypatch.setattr(recipe, "race", lambda arms, train: raced.extend(arms) or race(arms, train))
    sets = [arg for s in MICRO for arg in ("--set", s)]
    streamed = "streamed:training.tbptt_persist_across_steps=true,"
    streamed += "training.min_logical_block_size=32,optimizer.name=muon"
    argv = ["--data", str(data), "--budgets", "0.001", "--eval-bytes", "200", "--bdh", streamed]
    recipe.main([*argv, *sets, "--gpt-layers", "1,2", "--gpt", "drop:model.dropout=0.5"])
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| BDH")]
    rows += [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| GPT")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("BDH", "tiny's (adamw)"),
        ("BDH", "tiny's (muon)"),
        ("BDH", "streamed"),
        ("GPT", "tiny's (adamw), 1 layer"),
        ("GPT", "tiny's (adamw), 2 layers"),
        ("GPT", "tiny's (muon), 1 layer"),
        ("GPT", "tiny's (muon), 2 layers"),
        ("GPT", "tiny's (adamw), 1 layer, drop"),
        ("GPT", "tiny's (adamw), 2 layers, drop"),
        ("GPT", "tiny's (muon), 1 layer, drop"),
        ("GPT", "tiny's (muon), 2 layers, drop"),
    ]
    bdh_params = 3 * 2 * 16 * 32 + 2 * 256 * 16  # N = 4 * 16 / 2
    widths = [recipe.gpt_width(256, n, 2, bdh_params) for n in (1, 2)]
    gpt = [recipe.gpt_parameter_count(256, n, w) for n, w in zip((1, 2), widths, strict=True)]
    assert gpt[0] != gpt[1]  # two depths, each as wide as equal parameters allow
    assert all(r[2].strip() == "float32" for r in rows)  # tiny's 'auto', oneDNN capped
    assert [int(r[4].replace(",", "")) for r in rows] == [bdh_params] * 3 + gpt * 4
    assert all(int(r[5]) == 1 and int(r[6].replace(",", "")) == 32 for r in rows)
    for r in rows:  # an untrained byte model: near ln 256 nats, bits = nats / ln 2
        windows, sliding, stream, bits = (r[i].strip() for i in (9, 10, 11, 12))
        used = float(sliding if r[0].strip() == "GPT" else stream)
        assert (stream == "-") == (r[0].strip() == "GPT")
        assert all(abs(float(x) - math.log(256)) < 0.2 for x in (windows, sliding, used))
        assert float(bits) == pytest.approx(used / math.log(2), abs=1e-4)
    assert "BDH streamed against GPT tiny's (muon)" in out
    gpt_dropout = [a.model.drop.p for a in raced if a.model_name == "GPT"]
    assert gpt_dropout == [0.0] * 4 + [0.5] * 4  # --gpt's overrides reach its arms only


def test_training_dtype_bfloat16_runs_every_arms_forward_under_autocast(monkeypatch):
    """`--set training.dtype=bfloat16` reaches BDH's arms (a streamed one through the trainer's
    step) and the GPT's alike: every forward of their priming and their steps runs under
    bfloat16 autocast, and none without it. 'auto' on a CPU with AMX casts BDH's and leaves
    the GPT's in float32 (each model's faster precision there)."""
    bf16 = recipe.Recipe("tiny", (*MICRO, "training.dtype=bfloat16"))
    streamed = ["training.tbptt_persist_across_steps=true", "training.min_logical_block_size=64"]
    plain = recipe.Recipe("tiny", (*MICRO, "training.dtype=float32"))
    auto = recipe.Recipe("tiny", (*MICRO, "training.dtype=auto"))
    monkeypatch.setattr(training_config, "cpu_has_bfloat16_tiles", lambda: True)
    arms = [
        (recipe.bdh_arm(bf16, "adamw", FRESH_BLOCKS, 1.0, "b"), True),
        (recipe.bdh_arm(bf16, "muon", streamed, 1.0, "s"), True),
        (recipe.gpt_arm(bf16, "adamw", 10_000, 1.0, 1), True),
        (recipe.bdh_arm(plain, "adamw", streamed, 1.0, "s32"), False),
        (recipe.gpt_arm(plain, "adamw", 10_000, 1.0, 1), False),
        (recipe.bdh_arm(auto, "adamw", streamed, 1.0, "auto"), True),
        (recipe.gpt_arm(auto, "adamw", 10_000, 1.0, 1), False),
    ]
    assert type(arms[0][0]) is recipe.Arm and isinstance(arms[1][0], recipe.StreamedArm)
    train = torch.arange(1000) % 256
    for arm, cast in arms:
        seen: list[bool] = []  # at each embedding lookup: a forward of the model, any entry
        for module in arm.model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.register_forward_pre_hook(
                    lambda *_, seen=seen: seen.append(torch.is_autocast_enabled("cpu"))
                )
        arm.prime(train)
        arm.step(train)
        assert len(seen) >= 2 and seen == [cast] * len(seen), arm.recipe


def test_a_gpt_arm_takes_its_overrides_and_names_them():
    """`--gpt LABEL:...`'s arms: the overrides reach the GPT's dropout and its optimizer
    ('key*f' scales the recipe's value), the label follows the depth; the plain arm keeps the
    recipe's (tiny: dropout 0, lr 3e-3)."""
    base = recipe.Recipe("tiny", tuple(MICRO))
    plain = recipe.gpt_arm(base, "adamw", 10_000, 1.0, 2)
    tuned = recipe.gpt_arm(
        base, "adamw", 10_000, 1.0, 2, ["model.dropout=0.25", "optimizer.lr*2"], "tuned"
    )
    assert (plain.recipe, tuned.recipe) == (
        "tiny's (adamw), 2 layers",
        "tiny's (adamw), 2 layers, tuned",
    )
    assert (plain.model.drop.p, tuned.model.drop.p) == (0.0, 0.25)
    assert all(b.dropout == 0.25 for b in tuned.model.blocks)
    assert (plain.optim.lr, tuned.optim.lr) == (3e-3, 6e-3)
    assert [g["lr"] for g in tuned.optimizer.param_groups] == [6e-3] * len(
        tuned.optimizer.param_groups
    )
    assert plain.params == tuned.params  # the same width: overrides do not resize it


def test_sweep_variants_are_named_whole_and_an_unknown_one_is_refused(text_for_main, capsys):
    """Variant names hold commas ('D/2, N x2'), so --variants separates them with ';'; a name
    that is not a variant is one usage error (exit 2), not a traceback."""
    data = text_for_main
    sets = [arg for s in [*MICRO, *FRESH_BLOCKS] for arg in ("--set", s)]
    argv = ["--data", str(data), "--budgets", "0.001", "--eval-bytes", "200", "--sweep"]
    recipe.main([*argv, "--optimizers", "adamw", "--variants", "D/2, N x2;batch x2", *sets])
    out = capsys.readouterr().out
    labels = [line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| BDH")]
    assert labels == ["tiny's", "D/2, N x2", "batch x2"]
    with pytest.raises(SystemExit) as refused:
        recipe.main([*argv, "--variants", "D/2", *sets])
    assert refused.value.code == 2
    assert "--variants: no variant 'D/2'" in capsys.readouterr().err
