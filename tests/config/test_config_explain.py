"""`bdh-train config --explain` and docs/config.md: every key described, from the dataclasses."""

from __future__ import annotations

from pathlib import Path

import pytest

from bdh_train.cli import main
from bdh_train.config import RunConfig
from bdh_train.config.explain import explain_keys, explain_markdown, select_keys
from bdh_train.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _leaf_keys(table: dict, prefix: str) -> set[str]:
    keys = set()
    for name, value in table.items():
        path = f"{prefix}.{name}" if prefix else name
        keys |= _leaf_keys(value, path) if isinstance(value, dict) else {path}
    return keys


def test_every_key_has_a_description():
    missing = [k.key for k in explain_keys() if not k.description]
    assert not missing, f"add a docstring under these config fields: {missing}"


def test_every_key_of_a_run_config_is_explained():
    explained = {k.key for k in explain_keys()}
    assert _leaf_keys(RunConfig().to_dict(), "") <= explained


def test_docs_config_md_is_current():
    assert DOCS.read_text() == explain_markdown(), (
        "docs/config.md is stale: run `bdh-train config --explain --markdown > docs/config.md`"
    )


def test_allowed_values_and_defaults_come_from_the_dataclasses():
    (device,) = select_keys("training.device")
    assert device.default == '"auto"'
    assert device.allowed == "one of 'auto', 'cpu', 'cuda'"
    (lr,) = select_keys("optimizer.lr")
    assert lr.default == "0.001" and lr.allowed == "a positive number"
    (betas,) = select_keys("optimizer.betas")
    assert betas.default == "[0.9, 0.95]"
    ramp = select_keys("training.gradient_scales[].schedule.final_scale")
    assert ramp[0].allowed == "a non-negative number"


def test_explain_a_section_and_an_unknown_key(capsys):
    assert main(["config", "--explain", "optimizer"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# values as layered on preset tiny")
    assert out[1] == "optimizer.lr = 0.003  (a positive number; dataclass default 0.001)"
    assert not any(line.startswith("training.") for line in out)
    with pytest.raises(ConfigError, match="did you mean 'training.device'"):
        select_keys("trainig.device")
    assert main(["config", "--explain", "trainig.device"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown config key")


# ------------------------------------------------------------------ finding a key
def _explained(capsys, *args: str) -> dict[str, str]:
    """`config --explain ...`'s lines by key: {key: the rest of its line}."""
    assert main(["config", "--explain", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    return {
        line.split(" = ", 1)[0]: line.split(" = ", 1)[1]
        for line in lines
        if " = " in line and not line.startswith((" ", "#"))
    }


def test_explain_shows_the_value_under_the_chosen_preset(capsys):
    """tiny (the default preset) trains 1300 steps, small 2000; the dataclass says 3000. A key
    whose value is the dataclass default shows no second value."""
    tiny = (RunConfig().training.max_steps, 1300)
    assert _explained(capsys, "training.max_steps") == {
        "training.max_steps": f"{tiny[1]}  (a positive integer; dataclass default {tiny[0]})"
    }
    small = _explained(capsys, "training.max_steps", "--preset", "small")
    assert small["training.max_steps"].startswith("2000  (")
    overridden = _explained(capsys, "training.max_steps", "--set", "training.max_steps=7")
    assert overridden["training.max_steps"].startswith("7  (")
    assert _explained(capsys, "training.device")["training.device"] == (
        "\"auto\"  (one of 'auto', 'cpu', 'cuda')"
    )


def test_explain_a_word_searches_the_key_names(capsys):
    assert list(_explained(capsys, "lr")) == ["optimizer.lr", "optimizer.min_lr"]
    # no key holds the word: the near names
    assert list(_explained(capsys, "warmup_stpes")) == [
        "model.quant.warmup_steps",
        "optimizer.warmup_steps",
    ]
    assert main(["config", "--explain", "zzzz"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown config key 'zzzz'; ")


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("training.lr", "optimizer.lr"),  # a key of that name in another section
        ("model.block_size", "training.block_size"),
        ("training.blok_size", "block_size"),  # a near name in the same table: bare
        ("optimizer.warmup", "warmup_steps"),
        # a near section: the whole key (in a file, [train] is a section: 'training')
        ("train.max_steps", "training.max_steps"),
    ],
)
def test_an_unknown_key_names_the_nearest_key_in_any_section(tmp_path, capsys, given, meant):
    """The same hint in --set, in a config file and in --explain (config/keys.py)."""
    hint = f"(did you mean {meant!r}?)"
    assert main(["config", "--set", f"{given}=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith(hint), err
    section, key = given.rsplit(".", 1)
    config = tmp_path / "c.toml"
    config.write_text(f"[{section}]\n{key} = 1\n")
    assert main(["config", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    in_file = hint if section != "train" else "(did you mean 'training'?)"
    assert err.startswith(f"error: {config.resolve()}: unknown ")
    assert err.rstrip().endswith(in_file)
    assert main(["config", "--explain", given]) == 2
    whole = meant if "." in meant else f"{section}.{meant}"
    assert f"(did you mean {whole!r}?)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("max_steps", "'training.max_steps'"),
        ("lr", "'optimizer.lr'"),
        ("schedule", "'optimizer.schedule' or 'parallel.schedule'"),  # every section's
    ],
)
def test_a_key_without_its_section_names_the_section_s_key(tmp_path, capsys, given, meant):
    """A top-level key that some section holds: in --set and in a config file."""
    hint = f"(did you mean {meant}?)"
    assert main(["config", "--set", f"{given}=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set ") and err.rstrip().endswith(hint), err
    config = tmp_path / "c.toml"
    config.write_text(f"{given} = 1\n")
    assert main(["config", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {config.resolve()}: unknown section {given!r}")
    assert err.rstrip().endswith(hint), err


@pytest.mark.parametrize("given", ["path", "trainng", "target"])
def test_a_sectionless_set_names_only_keys_it_can_reach(capsys, given):
    """No hint for a name no --set key ends in: a section's name, a near miss, a key inside a
    list (training.gradient_scales[].target)."""
    assert main(["config", "--set", f"{given}=1"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(f"got {given!r}"), err
