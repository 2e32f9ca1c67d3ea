"""The shared helpers: the atomic file write."""

from __future__ import annotations

import os
import stat

import pytest

from bdh_train.config import RunConfig, save_config
from bdh_train.utils import atomic_write


@pytest.fixture
def umask():
    """Set a umask for one test and restore the process's own afterwards."""
    saved = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(saved)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_atomic_write_gives_the_mode_open_would(tmp_path, umask, mask):
    umask(mask)
    with atomic_write(tmp_path / "a.txt") as handle:
        handle.write("x")
    with open(tmp_path / "plain.txt", "w") as handle:
        handle.write("x")
    expected = stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)
    assert expected == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == expected
    assert os.umask(mask) == mask  # the helper leaves the umask as it found it


def test_a_saved_config_is_readable_by_the_group_under_umask_022(tmp_path, umask):
    umask(0o022)
    save_config(RunConfig(), tmp_path / "config.toml")
    assert stat.S_IMODE((tmp_path / "config.toml").stat().st_mode) == 0o644


def test_a_checkpoint_directory_and_its_files_follow_the_umask(tmp_path, umask):
    from bdh_train.storage.checkpoint import save_checkpoint

    umask(0o022)

    def write(directory):
        (directory / "weights.bin").write_bytes(b"\0")

    final = save_checkpoint(tmp_path, "step-0000001", write)
    assert stat.S_IMODE(final.stat().st_mode) == 0o755
    for child in final.iterdir():
        assert stat.S_IMODE(child.stat().st_mode) == 0o644, child.name
    assert stat.S_IMODE((final.parent / "latest").stat().st_mode) == 0o644
