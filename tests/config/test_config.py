"""The run configuration: presets, layering, --set parsing, validation messages, round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FRESH_BLOCKS

from bdh_train.config import (
    DEFAULT_PRESET,
    PRESETS,
    RunConfig,
    dump_toml,
    load_config,
    parse_override,
    save_config,
)
from bdh_train.config.layering import deep_merge
from bdh_train.errors import ConfigError
from bdh_train.train import GradientScale, GradientScaleRamp, InitTransferConfig


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_loads_and_validates(name: str) -> None:
    cfg = load_config(preset=name)
    assert isinstance(cfg, RunConfig)
    assert cfg.validate() is cfg


def test_default_is_tiny_when_no_files() -> None:
    assert DEFAULT_PRESET == "tiny"
    assert load_config() == load_config(preset="tiny")
    # overrides alone still start from the default preset
    assert load_config(overrides=["training.max_steps=7"]).model.n_layer == 2


def test_a_file_without_extends_layers_on_the_default_preset(tmp_path: Path) -> None:
    # A file that extends no preset sits on 'tiny', as the CLI's no-config default does (it
    # used to sit on the dataclass defaults: a 25 M-parameter, 3,000-step run).
    f = write(tmp_path / "a.toml", "[training]\nmax_steps = 9\n")
    cfg = load_config([f])
    tiny = load_config(preset="tiny")
    assert cfg.training.max_steps == 9
    assert cfg.model == tiny.model and cfg.optimizer == tiny.optimizer
    assert cfg.layered_on == "preset tiny (the default: no config file extends a preset)"
    # A file extending only another file still gets the default under the whole chain.
    g = write(tmp_path / "b.toml", 'extends = "a.toml"\n[model]\nn_layer = 3\n')
    assert load_config([g]).model == tiny.model.__class__(**{**vars(tiny.model), "n_layer": 3})
    # A chain that names a preset, or --preset, is layered on that one and no other.
    h = write(tmp_path / "c.toml", 'extends = "preset:small"\n')
    assert load_config([h]).model == load_config(preset="small").model
    assert load_config([h]).layered_on == "preset small (extended by the config)"
    assert load_config([f], preset="small").layered_on == "preset small (--preset)"
    assert load_config().layered_on == "preset tiny (the default: no config file given)"
    # A complete saved config.toml can be read with no base under it.
    assert load_config([f], default_preset=False).model == RunConfig().model
    assert load_config([f], default_preset=False).layered_on is None


def test_preset_contents() -> None:
    tiny = load_config(preset="tiny")
    assert (tiny.model.n_layer, tiny.model.n_embd, tiny.model.n_head) == (2, 128, 4)
    assert tiny.model.mlp_internal_dim_multiplier == 8 and tiny.model.dropout == 0.0
    assert (tiny.training.block_size, tiny.training.batch_size) == (128, 8)
    assert tiny.data.source == "builtin:shakespeare" and tiny.training.device == "auto"
    assert tiny.optimizer.schedule == "cosine" and tiny.optimizer.lr == 3e-3

    small = load_config(preset="small")
    assert (small.model.n_layer, small.model.n_embd, small.model.n_head) == (6, 256, 4)
    assert small.model.mlp_internal_dim_multiplier == 32
    assert (small.training.block_size, small.training.batch_size) == (512, 32)
    assert tiny.model.position == "alibi_slow"  # the state recipe: one slow head (tiny only)
    assert small.model.position == "alibi"  # unmeasured at small's size
    assert small.training.tbptt_persist_across_steps and tiny.training.tbptt_persist_across_steps
    assert (small.training.logical_block_size, tiny.training.logical_block_size) == (4096, 1024)

    pw = load_config(preset="pathway")
    m = pw.model
    assert (m.n_layer, m.n_embd, m.n_head, m.mlp_internal_dim_multiplier) == (6, 256, 4, 128)
    assert (m.dropout, m.vocab_size, m.position, m.norm) == (0.1, 256, "rope", "layernorm")
    assert (pw.optimizer.lr, pw.optimizer.weight_decay) == (1e-3, 0.1)
    assert (pw.training.block_size, pw.training.batch_size) == (512, 32)


def test_unknown_preset_suggests() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'tiyn'.*'tiny'"):
        load_config(preset="tiyn")


# --------------------------------------------------------------------------- layering


def test_later_files_override_earlier_and_tables_deep_merge(tmp_path: Path) -> None:
    a = write(tmp_path / "a.toml", "[training]\nmax_steps = 10\nbatch_size = 4\n")
    b = write(tmp_path / "b.toml", "[training]\nmax_steps = 20\n")
    cfg = load_config([a, b], preset="tiny")
    assert cfg.training.max_steps == 20
    assert cfg.training.batch_size == 4  # kept from a: tables merge
    assert cfg.training.block_size == 128  # kept from the preset
    assert load_config([b, a], preset="tiny").training.max_steps == 10


def test_lists_replace_rather_than_merge(tmp_path: Path) -> None:
    a = write(tmp_path / "a.toml", '[model.quant]\ntarget_modules = ["encoder"]\n')
    cfg = load_config([a])
    assert cfg.model.quant.target_modules == ["encoder"]


def test_extends_chain_and_order(tmp_path: Path) -> None:
    write(
        tmp_path / "base" / "base.toml",
        'extends = "preset:tiny"\n[training]\nmax_steps = 11\nlog_every = 3\n',
    )
    write(
        tmp_path / "mid.toml",
        'extends = ["base/base.toml"]\n[training]\nmax_steps = 12\n[model]\nn_layer = 2\n',
    )
    top = write(
        tmp_path / "top.toml", 'extends = ["mid.toml", "preset:tiny"]\n[training]\neval_steps = 2\n'
    )
    cfg = load_config([top])
    # preset:tiny listed after mid.toml overrides it; top's own values win over both
    assert cfg.training.max_steps == 1300
    assert cfg.model.n_layer == 2
    assert cfg.training.eval_steps == 2
    assert cfg.training.log_every == 50

    top2 = write(tmp_path / "top2.toml", 'extends = ["preset:tiny", "mid.toml"]\n')
    cfg2 = load_config([top2])
    assert (cfg2.training.max_steps, cfg2.model.n_layer, cfg2.training.log_every) == (12, 2, 3)


def test_extends_relative_to_the_file_not_cwd(tmp_path: Path, monkeypatch) -> None:
    write(tmp_path / "conf" / "base.toml", "[training]\nseed = 5\n")
    top = write(tmp_path / "conf" / "top.toml", 'extends = "base.toml"\n')
    monkeypatch.chdir(tmp_path)
    assert load_config([str(top)]).training.seed == 5


def test_diamond_extends_is_not_a_cycle(tmp_path: Path) -> None:
    write(tmp_path / "base.toml", "[training]\nseed = 1\n")
    write(tmp_path / "l.toml", 'extends = "base.toml"\n')
    write(tmp_path / "r.toml", 'extends = "base.toml"\n')
    top = write(tmp_path / "top.toml", 'extends = ["l.toml", "r.toml"]\n')
    assert load_config([top]).training.seed == 1


def test_extends_cycle_names_the_files(tmp_path: Path) -> None:
    write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match=r"cycle.*a\.toml -> .*b\.toml -> .*a\.toml"):
        load_config([tmp_path / "a.toml"])


def test_self_extends_is_a_cycle(tmp_path: Path) -> None:
    write(tmp_path / "a.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_config([tmp_path / "a.toml"])


def test_extends_bad_type(tmp_path: Path) -> None:
    f = write(tmp_path / "a.toml", "extends = 3\n")
    with pytest.raises(ConfigError, match="extends must be a string or a list of strings"):
        load_config([f])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found: .*nope.toml"):
        load_config([tmp_path / "nope.toml"])


def test_missing_extended_file_names_the_referrer(tmp_path: Path) -> None:
    f = write(tmp_path / "a.toml", 'extends = "gone.toml"\n')
    with pytest.raises(ConfigError, match=r"gone\.toml \(extended by .*a\.toml\)"):
        load_config([f])


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    f = write(tmp_path / "bad.toml", "[training]\nmax_steps = 3\nblock_size = = 4\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: invalid TOML.*line 3"):
        load_config([f])


def test_unknown_section_and_key_in_file(tmp_path: Path) -> None:
    f = write(tmp_path / "a.toml", "[trainng]\nmax_steps = 3\n")
    with pytest.raises(ConfigError, match="unknown section 'trainng'.*'training'"):
        load_config([f])
    g = write(tmp_path / "b.toml", "[training]\nblok_size = 3\n")
    with pytest.raises(ConfigError, match=r"training\.blok_size.*'block_size'"):
        load_config([g])
    h = write(tmp_path / "c.toml", "[model.quant]\nenabel = true\n")
    with pytest.raises(ConfigError, match=r"model\.quant\.enabel.*'enable'"):
        load_config([h])


def test_deep_merge_does_not_mutate() -> None:
    base = {"a": {"b": 1, "c": [1]}}
    top = {"a": {"c": [2]}}
    assert deep_merge(base, top) == {"a": {"b": 1, "c": [2]}}
    assert base == {"a": {"b": 1, "c": [1]}}


# --------------------------------------------------------------------------- --set


@pytest.mark.parametrize(
    ("item", "getter", "expected"),
    [
        ("training.max_steps=30", lambda c: c.training.max_steps, 30),
        ("optimizer.lr=5e-3", lambda c: c.optimizer.lr, 5e-3),
        ("optimizer.weight_decay = 0.5", lambda c: c.optimizer.weight_decay, 0.5),
        ("training.compile=true", lambda c: c.training.compile, "auto"),
        ("training.compile=false", lambda c: c.training.compile, "off"),
        ("training.compile=pointwise", lambda c: c.training.compile, "pointwise"),
        ("training.recompute='layer'", lambda c: c.training.recompute, "layer"),
        ('model.position="alibi"', lambda c: c.model.position, "alibi"),
        ("model.position=alibi", lambda c: c.model.position, "alibi"),
        ("data.source=/tmp/some text.txt", lambda c: c.data.source, "/tmp/some text.txt"),
        ("data.source=builtin:pydoc", lambda c: c.data.source, "builtin:pydoc"),
        ("model.quant.enable=true", lambda c: c.model.quant.enable, True),
        ("data.nca.grid_size=16", lambda c: c.data.nca.grid_size, 16),
        ("optimizer.betas=[0.8, 0.9]", lambda c: c.optimizer.betas, [0.8, 0.9]),
        ("checkpoint.resume=runs/x", lambda c: c.checkpoint.resume, "runs/x"),
        (
            "training.init_transfer.backbone_grad_scale=0.5",
            lambda c: c.training.init_transfer.backbone_grad_scale,
            0.5,
        ),
        (
            "model.quant={enable = true, warmup_steps = 3}",
            lambda c: (c.model.quant.enable, c.model.quant.warmup_steps, c.model.quant.act_format),
            (True, 3, "int8"),
        ),
    ],
)
def test_set_overrides(item: str, getter, expected) -> None:
    assert getter(load_config(overrides=[item])) == expected


def test_set_gradient_scales_list_of_tables() -> None:
    cfg = load_config(
        overrides=[
            'training.gradient_scales=[{target="embedding", scale=0.1, '
            "schedule={final_scale=1.0, start_fraction=0.2, end_fraction=0.5}}]"
        ]
    )
    (item,) = cfg.training.gradient_scales
    assert item == GradientScale("embedding", 0.1, GradientScaleRamp(1.0, 0.2, 0.5))


def test_old_module_lr_scales_key_is_read_with_a_deprecation_line(tmp_path: Path, capsys) -> None:
    table = '[{target="embedding", scale=0.1}]'
    from_set = load_config(overrides=[f"training.module_lr_scales={table}"])
    assert "training.module_lr_scales is deprecated" in capsys.readouterr().err
    f = write(tmp_path / "old.toml", f"[training]\nmodule_lr_scales = {table}\n")
    from_file = load_config([f])
    assert "training.module_lr_scales is deprecated" in capsys.readouterr().err
    for cfg in (from_set, from_file):
        assert cfg.training.gradient_scales == [GradientScale("embedding", 0.1, None)]


def test_set_applies_after_files_in_order(tmp_path: Path) -> None:
    f = write(tmp_path / "a.toml", "[training]\nmax_steps = 10\n")
    cfg = load_config([f], overrides=["training.max_steps=20", "training.max_steps=40"])
    assert cfg.training.max_steps == 40


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("training.max_steps", "expected section.key=value"),
        ("max_steps=3", "dotted path like section.key"),
        ("training..x=3", "dotted path"),
        ("training.blok_size=3", r"unknown key training\.blok_size.*'block_size'"),
        ("trainig.max_steps=3", r"unknown section trainig.*'training\.max_steps'"),
        ("model.quant.enabel=true", r"unknown key model\.quant\.enabel.*'enable'"),
        ("training.max_steps.x=1", r"training\.max_steps is not a table"),
        ("training.max_steps=abc", r"training\.max_steps must be a positive integer, got 'abc'"),
    ],
)
def test_bad_set_names_it(item: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[item])
    if "must be" not in message:
        with pytest.raises(ConfigError, match=r"--set"):
            load_config(overrides=[item])


def test_parse_override_nests() -> None:
    assert parse_override("model.quant.enable=false") == {"model": {"quant": {"enable": False}}}


# --------------------------------------------------------------------------- validation


BAD_VALUES = [
    ("training.block_size=-3", "training.block_size must be a positive integer, got -3"),
    ("training.block_size=0", "training.block_size must be a positive integer, got 0"),
    ("training.block_size=1.5", "training.block_size must be a positive integer, got 1.5"),
    ("training.block_size=true", "training.block_size must be a positive integer, got True"),
    ("training.batch_size=0", "training.batch_size must be a positive integer"),
    ("training.tbptt_chunk_size=-1", "training.tbptt_chunk_size must be a non-negative integer"),
    ("training.tbptt_backprop_chunks=0", "training.tbptt_backprop_chunks must be a positive"),
    (
        "training.tbptt_persist_across_steps=1",
        "training.tbptt_persist_across_steps must be true or false, got 1",
    ),
    (
        "training.min_logical_block_size=-1",
        "training.min_logical_block_size must be a non-negative integer, got -1",
    ),
    ("training.gradient_accumulation_steps=0", "training.gradient_accumulation_steps must be"),
    (
        "training.target_tokens_per_step=1000",
        "training.target_tokens_per_step must be a multiple of training.block_size * "
        "training.batch_size (1024)",
    ),
    ("training.max_steps=0", "training.max_steps must be a positive integer"),
    ("training.seed=-1", "training.seed must be a non-negative integer"),
    ("training.log_every=-1", "training.log_every must be a non-negative integer (0 disables"),
    ("training.eval_every=x", "training.eval_every must be a non-negative integer"),
    ("training.eval_steps=0", "training.eval_steps must be a positive integer"),
    ("training.checkpoint_every=-5", "training.checkpoint_every must be a non-negative"),
    ("training.keep_checkpoints=-1", "training.keep_checkpoints must be a non-negative"),
    ("training.threads=-1", "training.threads must be a non-negative integer, got -1"),
    ("training.threads=100000", "training.threads = 100000 is more than this machine's"),
    ("training.device=gpu", "training.device must be one of 'auto', 'cpu', 'cuda', got 'gpu'"),
    ("training.dtype=float16", "training.dtype must be one of 'float32', 'bfloat16', 'auto'"),
    (
        'training.compile="yes"',
        "training.compile must be one of 'off', 'layer', 'pointwise', 'auto', got 'yes'",
    ),
    (
        'training.compile="layers"',
        "training.compile must be one of 'off', 'layer', 'pointwise', "
        "'auto', got 'layers' (did you mean 'layer'?)",
    ),
    (
        "training.recompute='layers'",
        "training.recompute must be one of 'none', 'layer', "
        "'mixer', got 'layers' (did you mean 'layer'?)",
    ),
    ("training.profile=0", "training.profile must be one of 'off', 'step', 'detail', got 0"),
    (
        "training.profile='details'",
        "training.profile must be one of 'off', 'step', 'detail', got "
        "'details' (did you mean 'detail'?)",
    ),
    ("training.profile_memory=1", "training.profile_memory must be true or false, got 1"),
    ("training.max_consecutive_skips=-1", "training.max_consecutive_skips must be"),
    ("training.gradient_scales=3", "training.gradient_scales must be a list of tables"),
    ("training.gradient_scales=[3]", r"training.gradient_scales[0] must be a table"),
    (
        'training.gradient_scales=[{target="encoder"}]',
        "training.gradient_scales[0].target must be one of 'embedding'",
    ),
    (
        'training.gradient_scales=[{target="embedding", scale=-1}]',
        "training.gradient_scales[0].scale must be a non-negative number, got -1",
    ),
    (
        'training.gradient_scales=[{target="embedding", scal=1}]',
        "unknown key training.gradient_scales[0].scal (did you mean 'scale'?)",
    ),
    (
        'training.gradient_scales=[{target="embedding"}, {target="embedding"}]',
        "training.gradient_scales[1].target 'embedding' repeats",
    ),
    (
        'training.gradient_scales=[{target="embedding", schedule={start_fraction=1.5}}]',
        "training.gradient_scales[0].schedule.start_fraction must be a number in [0, 1]",
    ),
    (
        'training.gradient_scales=[{target="embedding", schedule={end_fraction=-0.1}}]',
        "training.gradient_scales[0].schedule.end_fraction must be a number in [0, 1]",
    ),
    (
        'training.gradient_scales=[{target="embedding", '
        "schedule={start_fraction=0.6, end_fraction=0.5}}]",
        "training.gradient_scales[0].schedule.start_fraction (0.6) must be <=",
    ),
    (
        'training.gradient_scales=[{target="embedding", schedule={final_scale=-2.0}}]',
        "training.gradient_scales[0].schedule.final_scale must be a non-negative number",
    ),
    (
        'training.gradient_scales=[{target="embedding", schedule=2}]',
        "training.gradient_scales[0].schedule must be a table",
    ),
    (
        "training.init_transfer.backbone_grad_scale=-1",
        "training.init_transfer.backbone_grad_scale must be a non-negative number",
    ),
    (
        "training.init_transfer.backbone_grad_scale_steps=-1",
        "training.init_transfer.backbone_grad_scale_steps must be a non-negative integer",
    ),
    (
        "training.init_transfer.preserve_fresh_decoder=1",
        "training.init_transfer.preserve_fresh_decoder must be true or false",
    ),
    (
        "training.init_transfer.preserve_fresh_norm=no",
        "training.init_transfer.preserve_fresh_norm must be true or false",
    ),
    ("training.init_transfer=3", "training.init_transfer must be a table, got 3"),
    ("optimizer.lr=0", "optimizer.lr must be a positive number, got 0"),
    ("optimizer.lr=nan", "optimizer.lr must be a positive number, got nan"),
    ("optimizer.lr=inf", "optimizer.lr must be a positive number, got inf"),
    ('optimizer.lr="0.1"', "optimizer.lr must be a positive number, got '0.1'"),
    ("optimizer.betas=[0.9]", "optimizer.betas must be a list of two numbers in [0, 1)"),
    ("optimizer.betas=[0.9, 1.0]", "optimizer.betas must be a list of two numbers in [0, 1)"),
    ("optimizer.betas=0.9", "optimizer.betas must be a list of two numbers"),
    ("optimizer.eps=0", "optimizer.eps must be a positive number"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay must be a non-negative number"),
    ("optimizer.warmup_steps=-1", "optimizer.warmup_steps must be a non-negative integer"),
    (
        "optimizer.schedule=cosin",
        "optimizer.schedule must be one of 'constant', 'cosine', 'linear', 'wsd', got 'cosin' "
        "(did you mean",
    ),
    ("optimizer.min_lr=-1", "optimizer.min_lr must be a non-negative number"),
    ("optimizer.min_lr=1.0", "optimizer.min_lr must be <= optimizer.lr"),
    ("optimizer.grad_clip_norm=-1", "optimizer.grad_clip_norm must be a non-negative number"),
    ("checkpoint.init_from=3", "checkpoint.init_from must be a string, got 3"),
    ("checkpoint.resume=true", "checkpoint.resume must be a string, got True"),
    ("data.source=3", "data.source must be a string, got 3"),
    ('data.source=""', "data.source must be 'builtin:<name>', 'nca', 'mqar' or a path"),
    ("data.source=builtin:pydcs", "unknown builtin corpus 'pydcs'"),
    ("data.val_fraction=1.0", "data.val_fraction must be a number in [0, 1), got 1.0"),
    ("data.val_fraction=-0.1", "data.val_fraction must be a number in [0, 1)"),
    ("data.nca.grid_size=0", "data.nca.grid_size must be a positive integer"),
    ("data.nca.grid_size=7", "data.nca.grid_size must be a multiple of data.nca.patch_size"),
    ("data.nca.state_count=1", "data.nca.state_count must be an integer >= 2"),
    ("data.nca.steps=0", "data.nca.steps must be a positive integer"),
    ("data.nca.patch_size=0", "data.nca.patch_size must be a positive integer"),
    ("data.nca.seed=-1", "data.nca.seed must be a non-negative integer"),
    ("data.nca.rule_count=0", "data.nca.rule_count must be a positive integer"),
    ("parallel.pipeline_stages=0", "parallel.pipeline_stages must be a positive integer"),
    ("parallel.virtual_stages_per_rank=0", "parallel.virtual_stages_per_rank must be in [1, "),
    (
        "parallel.virtual_stages_per_rank=2",
        "parallel.virtual_stages_per_rank must be in [1, parallel.pipeline_stages (1)], got 2",
    ),
    ("parallel.microbatches=0", "parallel.microbatches must be a positive integer"),
    ("parallel.microbatches=17", "parallel.microbatches must be <= training.batch_size (8)"),
    (
        "parallel.schedule=zb",
        "parallel.schedule must be one of 'gpipe', 'interleaved_1f1b', '1f1b'",
    ),
    ("parallel.emulate=1", "parallel.emulate must be true or false"),
    # [model] goes through BDHConfig.validate
    ("model.n_layer=0", "model.n_layer must be a positive integer, got 0"),
    ("model.n_embd=130", "model.n_embd must be divisible by model.n_head"),
    ("model.dropout=1.0", "model.dropout must be a number in [0, 1)"),
    ("model.position=learned", "model.position must be one of 'rope', 'alibi'"),
    ("model.executor=fast", "model.executor must be one of"),
    ("model.quant.enable=1", "model.quant.enable must be true or false"),
    ("model.quant.weight_format=int4", "model.quant.weight_format must be one of"),
    ("model.language_head.type=patch", "model.language_head.type must be one of"),
    ("model.quant=3", "model.quant must be a table, got 3"),
]


@pytest.mark.parametrize(("item", "message"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_each_invalid_field_is_named(item: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[item])
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["training.gradient_accumulation_steps=2", "training.target_tokens_per_step=4096"],
            "set either training.target_tokens_per_step or training.gradient_accumulation_steps",
        ),
        (
            ["parallel.pipeline_stages=2", "training.tbptt_chunk_size=32"],
            "pipeline parallelism (parallel.pipeline_stages=2) does not support truncated BPTT",
        ),
        (
            ["parallel.pipeline_stages=2", "training.tbptt_persist_across_steps=true"],
            "does not support streamed state",
        ),
        (
            ["parallel.pipeline_stages=2", "training.min_logical_block_size=256"],
            "does not support streamed state",
        ),
        (
            [
                "parallel.pipeline_stages=2",
                "training.stream_documents='corpus'",
                "training.min_logical_block_size=0",
            ],
            "training.stream_documents='fixed'",
        ),
        (
            ["training.stream_documents='corpus'", "training.min_logical_block_size=1024"],
            "training.min_logical_block_size = 1024 cuts the stream into fixed-length documents",
        ),
        (
            [
                "training.stream_documents='corpus'",
                "training.min_logical_block_size=0",
                "model.summary_memory.enabled=true",
            ],
            "training.stream_documents = 'corpus' resets a row's state at the token where",
        ),
        (
            ["parallel.pipeline_stages=8", "parallel.virtual_stages_per_rank=1"],
            "model.n_layer must be >= parallel.pipeline_stages * parallel.virtual_stages_per_rank",
        ),
        (
            ["parallel.pipeline_stages=2", "parallel.virtual_stages_per_rank=2"],
            "needs parallel.schedule in 'gpipe', 'interleaved_1f1b'",
        ),
        (
            [
                "data.source=nca",
                "model.vocab_size=32",
                'model.language_head={type="nca_factorized_patch", state_count=2, patch_size=1}',
            ],
            "model.language_head.patch_size must equal data.nca.patch_size (2), got 1",
        ),
        *(
            (
                [
                    f"data.source={source!r}",
                    'model.language_head={type="nca_factorized_patch", state_count=2, '
                    "patch_size=2}",
                ],
                f"model.language_head.type = 'nca_factorized_patch' predicts patch ids (0..15, "
                f"grids of cells), but data.source = {source!r} is byte text",
            )
            for source in ("builtin:pydoc", "corpus.txt", "some/dir")
        ),
    ],
)
def test_cross_field_checks(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
@pytest.mark.parametrize("virtual", [1, 2])
def test_plan_and_train_agree_on_the_pipeline_shape(schedule: str, virtual: int) -> None:
    """`bdh-train plan` and a training config accept and refuse the same pipeline shapes,
    with the same message (one rule, one home)."""
    from bdh_train.distributed.planner import build_pipeline_plan

    def outcome(make) -> str:
        try:
            make()
        except ConfigError as exc:
            return str(exc)
        return "accepted"

    planned = outcome(lambda: build_pipeline_plan(4, 2, virtual, 4, schedule))
    trained = outcome(
        lambda: load_config(
            overrides=[
                *FRESH_BLOCKS,
                "model.n_layer=4",
                "parallel.pipeline_stages=2",
                f"parallel.virtual_stages_per_rank={virtual}",
                "parallel.microbatches=4",
                f"parallel.schedule={schedule}",
            ]
        )
    )
    assert planned == trained
    assert (planned == "accepted") == (virtual == 1 or schedule != "1f1b")


def test_valid_cross_field_combinations() -> None:
    cfg = load_config(
        overrides=[
            "training.tbptt_chunk_size=32",
            "training.tbptt_backprop_chunks=2",
            "training.tbptt_persist_across_steps=true",
            "training.min_logical_block_size=512",
        ]
    )
    assert cfg.training.logical_block_size == 512 and cfg.training.streaming
    cfg = load_config(overrides=["training.target_tokens_per_step=8192"])
    assert cfg.training.accumulation_steps == 8 and cfg.training.tokens_per_step == 8192
    assert load_config().training.accumulation_steps == 1
    assert load_config().training.logical_block_size == 1024  # the tiny preset streams
    cfg = load_config(
        overrides=[
            *FRESH_BLOCKS,
            "model.n_layer=4",  # a layer for each of the 2 x 2 virtual stages
            "parallel.pipeline_stages=2",
            "parallel.virtual_stages_per_rank=2",
            "parallel.schedule=interleaved_1f1b",
            "parallel.microbatches=4",
            "parallel.emulate=true",
        ]
    )
    assert cfg.parallel.pipeline_stages == 2
    cfg = load_config(
        overrides=[
            "data.source=nca",
            "model.vocab_size=32",
            'model.language_head={type="nca_factorized_patch", state_count=2, patch_size=2}',
        ]
    )
    assert cfg.data.source == "nca"
    # Token data (a .bin file) may carry patch ids: the head is allowed on it.
    cfg = load_config(
        overrides=[
            "data.source='patches.bin'",
            "model.vocab_size=32",
            'model.language_head={type="nca_factorized_patch", state_count=2, patch_size=2}',
        ]
    )
    assert cfg.model.language_head.type == "nca_factorized_patch"


@pytest.mark.parametrize(
    ("overrides", "field", "effective", "line"),
    [
        (
            ["training.tbptt_chunk_size=128"],
            "tbptt_chunk_size",
            0,
            "info: training.tbptt_chunk_size=128 >= training.block_size=128: no TBPTT chunking "
            "(tbptt_chunk_size set to 0)",
        ),
        (
            [
                *FRESH_BLOCKS,
                "training.tbptt_chunk_size=512",
                "parallel.pipeline_stages=2",
                "parallel.microbatches=2",
            ],
            "tbptt_chunk_size",
            0,
            "info: training.tbptt_chunk_size=512 >= training.block_size=128: no TBPTT chunking",
        ),
        (
            ["training.min_logical_block_size=200"],
            "min_logical_block_size",
            256,
            "info: training.min_logical_block_size=200 rounded up to 256, a multiple of "
            "training.block_size=128",
        ),
    ],
    ids=["chunk-equals-block", "chunk-beyond-block-with-pipeline", "logical-rounded-up"],
)
def test_settings_the_reference_accepts_are_normalised_once(
    overrides, field, effective, line, tmp_path: Path, capsys
) -> None:
    """As the reference does: a TBPTT chunk that covers the block means no chunking (so a
    pipeline, which refuses TBPTT, accepts it), and a logical length is rounded up to whole
    blocks. One info line says so; the dumped config holds the effective value, so loading it
    again (resume) is silent and unchanged."""
    cfg = load_config(overrides=overrides)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(line)
    assert getattr(cfg.training, field) == effective
    cfg.validate()  # the trainer validates again: nothing more is said
    save_config(cfg, tmp_path / "config.toml")
    assert load_config([tmp_path / "config.toml"]) == cfg
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("value", "mode"), [("true", "step"), ("false", "off"), ("'detail'", "detail")]
)
def test_profile_takes_a_mode_and_the_old_booleans(value: str, mode: str, tmp_path: Path) -> None:
    cfg = load_config(overrides=[f"training.profile={value}"])
    assert cfg.training.profile == mode
    save_config(cfg, tmp_path / "config.toml")
    assert f'profile = "{mode}"' in (tmp_path / "config.toml").read_text()
    assert load_config([tmp_path / "config.toml"]) == cfg


def test_config_and_loader_agree_on_the_logical_length() -> None:
    """One rounding rule (`logical_length_for`): the streaming loader given the raw value
    builds the same documents as the config's effective value."""
    from bdh_train.data import StreamingDocumentLoader

    cfg = load_config(overrides=["training.block_size=8", "training.min_logical_block_size=20"])
    assert cfg.training.logical_block_size == cfg.training.min_logical_block_size == 24
    assert cfg.training.streaming
    tokens = list(range(500))
    raw = StreamingDocumentLoader(tokens, 8, 2, logical_length=20, seed=0)
    assert raw.logical_length == 24 and raw.windows_per_doc == 3


def test_ints_accepted_where_floats_expected() -> None:
    cfg = load_config(overrides=["optimizer.lr=1", "optimizer.min_lr=0", "data.val_fraction=0"])
    assert cfg.optimizer.lr == 1


# --------------------------------------------------------------------------- round trip


def test_dump_load_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        preset="pathway",
        overrides=[
            'training.gradient_scales=[{target="embedding", scale=0.1, '
            "schedule={final_scale=1.0, start_fraction=0.2, end_fraction=0.5}}, "
            '{target="output_head", scale=2.0}]',
            "training.init_transfer.backbone_grad_scale=0.25",
            "training.init_transfer.backbone_grad_scale_steps=100",
            "model.language_head.eos_id=3",
            "checkpoint.init_from=runs/old",
        ],
    )
    assert cfg.training.gradient_scales[1].schedule is None
    assert cfg.training.init_transfer == InitTransferConfig(0.25, 100, False, False)
    path = tmp_path / "out" / "config.toml"
    save_config(cfg, path)
    assert load_config([path]) == cfg
    assert "null" not in dump_toml(cfg).lower()
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_round_trips(name: str, tmp_path: Path) -> None:
    cfg = load_config(preset=name)
    assert "eos_id" not in dump_toml(cfg)  # None omitted
    save_config(cfg, tmp_path / "c.toml")
    assert load_config([tmp_path / "c.toml"]) == cfg


def test_to_dict_and_from_dict() -> None:
    cfg = load_config()
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown section 'optimiser'.*'optimizer'"):
        RunConfig.from_dict({"optimiser": {}})


def test_default_run_config_validates() -> None:
    assert RunConfig().validate() == RunConfig()


OPTIMIZER_DEFAULTS = {  # OptimizerConfig as documented in config.py, field by field
    "lr": 1e-3,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "weight_decay": 0.1,
    "warmup_steps": 0,  # "optional warmup": off unless asked for
    "schedule": "constant",  # "optional ... cosine decay": off unless asked for
    "min_lr": 0.0,  # the cosine floor, ignored by 'constant'
    "decay_fraction": 0.2,  # wsd's decay share, ignored by the other schedules
    "grad_clip_norm": 1.0,  # clipping is ON by default (0 = off)
}


def test_the_documented_optimizer_defaults(tmp_path: Path) -> None:
    # The dataclass defaults; a file read with no base preset under it gets them. (A file
    # without extends read the normal way now sits on the tiny preset: its optimizer is tiny's.)
    f = write(tmp_path / "run.toml", "[training]\nmax_steps = 9\n[model]\nn_layer = 2\n")
    loaded = load_config([f], default_preset=False)
    for cfg in (loaded, RunConfig(), RunConfig().validate()):
        got = {name: getattr(cfg.optimizer, name) for name in OPTIMIZER_DEFAULTS}
        assert got == OPTIMIZER_DEFAULTS
        assert type(got["warmup_steps"]) is int and type(got["betas"]) is list
    assert load_config([f]).optimizer == load_config(preset="tiny").optimizer
    # An [optimizer] table that sets one key keeps the other values under it.
    g = write(tmp_path / "lr.toml", "[optimizer]\nlr = 0.002\n")
    got = {
        name: getattr(load_config([g], default_preset=False).optimizer, name)
        for name in OPTIMIZER_DEFAULTS
    }
    assert got == {**OPTIMIZER_DEFAULTS, "lr": 0.002}
    tiny = load_config(preset="tiny").optimizer
    assert load_config([g]).optimizer == type(tiny)(**{**vars(tiny), "lr": 0.002})


# --------------------------------------------------------------------------- tokenizer vocab


def test_vocab_size_follows_a_tokenizer_unless_a_file_or_set_gives_it(tmp_path: Path) -> None:
    """A preset's vocab_size gives way to data.tokenizer's size; one a config file or --set
    gives is checked against it: equal is fine, different is one error naming both."""
    from helpers import bpe_corpus

    tok, path, _ = bpe_corpus(tmp_path, vocab_size=280)
    use = f"data.tokenizer='{path}'"
    assert load_config(overrides=[use]).model.vocab_size == 280
    on_preset = write(
        tmp_path / "a.toml", f'extends = "preset:small"\n[data]\ntokenizer = "{path}"\n'
    )
    assert load_config([on_preset]).model.vocab_size == 280
    same = write(tmp_path / "b.toml", "[model]\nvocab_size = 280\n")
    assert load_config([same], [use]).model.vocab_size == 280
    other = write(tmp_path / "c.toml", "[model]\nvocab_size = 256\n")
    for files, overrides in (([other], [use]), ([], [use, "model.vocab_size=512"])):
        with pytest.raises(ConfigError) as err:
            load_config(files, overrides)
        message = str(err.value)
        size = 256 if files else 512
        assert f"model.vocab_size = {size}" in message and "has 280 ids" in message
        assert "set model.vocab_size = 280" in message and "\n" not in message
