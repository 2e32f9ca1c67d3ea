"""`bdh-train config --explain` and docs/config.md: every key described, from the dataclasses."""

from __future__ import annotations

from pathlib import Path

import pytest

from bdh_train.cli import main
from bdh_train.config import RunConfig
from bdh_train.config.explain import explain_keys, explain_markdown, select_keys
from bdh_train.errors import ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"


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
    out = capsys.readouterr().out
    assert out.startswith("optimizer.lr = 0.001  (a positive number)\n")
    assert "training." not in out
    with pytest.raises(ConfigError, match="did you mean 'training.device'"):
        select_keys("trainig.device")
    assert main(["config", "--explain", "trainig.device"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown config key")
