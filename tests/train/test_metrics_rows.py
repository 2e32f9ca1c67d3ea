"""metrics.jsonl is the user's record of a run: every reader (resume, `plot`, `profile`) reads
it through `read_metrics`, which refuses a line that is no metrics row with one error naming
the file and line, and leaves the file as it is; only a torn last line (a write cut short)
is left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bdh_train.cli import main
from bdh_train.errors import DataError
from bdh_train.train.metrics import MetricsLog, read_metrics

GOOD = [
    {"step": 1, "tokens": 64, "loss": 5.5, "lr": 0.001, "grad_norm": 2.0},
    {"step": 2, "tokens": 128, "loss": float("nan"), "lr": 0.002, "grad_norm": float("inf")},
    {"step": 2, "val_loss": 5.0},
    {"step": 3, "tokens": 192, "loss": 5.25, "lr": 0.003, "grad_norm": 1.0},
]
FIX = 'each line is a metrics row such as {"step": 3, "loss": 2.5}: correct that line or delete it'
BAD_ROWS = [
    ('{"step": "seven"}', '"step" is a JSON string, not a non-negative integer'),
    ('{"step": -1, "loss": 2.0}', '"step" is -1, not a non-negative integer'),
    ('{"step": 1.5, "loss": 2.0}', '"step" is 1.5, not a non-negative integer'),
    ('{"step": true}', '"step" is a JSON boolean, not a non-negative integer'),
    ('{"loss": 2.0}', 'no "step"'),
    ("[1, 2, 3]", "a JSON array, not an object"),
    ("7", "a JSON number, not an object"),
    ('"a row"', "a JSON string, not an object"),
    ('{"step": 1, "forward_s": "x"}', '"forward_s" is a JSON string, not a number'),
    ('{"step": 1, "loss": null}', '"loss" is a JSON null, not a number'),
    ('{"step": 1, "loss": [2.0]}', '"loss" is a JSON array, not a number'),
    ("{not json", "not JSON: Expecting property name enclosed in double quotes"),
]


def _write(run: Path, bad: str) -> Path:
    """metrics.jsonl of GOOD with `bad` as its second line; returns the file."""
    lines = [json.dumps(GOOD[0]), bad, *map(json.dumps, GOOD[1:])]
    path = run / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_rows_as_written_read_back_and_a_torn_last_line_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GOOD) + '\n{"step": 4, "tok')
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 2, 3]
    assert rows[0] == GOOD[0] and rows[3] == GOOD[3]
    log = MetricsLog(tmp_path, resume_step=2)
    assert log.dropped_torn_line
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 2]


@pytest.mark.parametrize(("bad", "problem"), BAD_ROWS, ids=[b for b, _ in BAD_ROWS])
def test_a_line_that_is_no_metrics_row_is_one_error_and_the_file_stays(
    tmp_path: Path, capsys, bad: str, problem: str
) -> None:
    path = _write(tmp_path, bad)
    before = path.read_bytes()
    message = f"{path}:2: {problem}"
    with pytest.raises(DataError) as refused:
        read_metrics(path)
    assert str(refused.value).startswith(message) and str(refused.value).endswith(
        f"; {FIX} to go on"
    )
    with pytest.raises(DataError) as refused:  # the resume of a run
        MetricsLog(tmp_path, resume_step=1)
    assert str(refused.value).startswith(message)
    for command in ("plot", "profile"):
        capsys.readouterr()
        assert main([command, str(tmp_path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"error: {message}") and err.count("\n") == 1
    assert path.read_bytes() == before
    assert not (tmp_path / "loss.png").exists() and not (tmp_path / "profile.png").exists()


def test_a_resume_over_a_bad_metrics_row_stops_with_one_line(tmp_path: Path, capsys) -> None:
    micro = [
        "model.n_layer=1",
        "model.n_embd=16",
        "model.n_head=2",
        "model.mlp_internal_dim_multiplier=2",
        "training.block_size=8",
        "training.batch_size=2",
        "training.log_every=1",
        "training.eval_every=0",
        "training.checkpoint_every=1",
        "training.max_steps=1",
    ]
    sets = [a for o in micro for a in ("--set", o)]
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *sets]) == 0
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + "[1, 2, 3]\n" + "".join(lines[1:]))
    before = path.read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}:2: a JSON array, not an object; {FIX} to go on\n"
    assert path.read_bytes() == before


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("bounded_memory")
def test_a_metrics_file_that_is_dev_zero_is_refused_at_once(tmp_path: Path, capsys) -> None:
    (tmp_path / "metrics.jsonl").symlink_to("/dev/zero")
    with pytest.raises(DataError) as refused:
        MetricsLog(tmp_path, resume_step=1)
    assert str(refused.value) == (
        f"{tmp_path / 'metrics.jsonl'} is a character device, not a regular file; give the "
        "path of a file"
    )


def test_rows_are_written_at_the_first_step_every_log_every_and_the_last(tmp_path: Path) -> None:
    """log_every 3 of 7 steps: rows at 1 (where the console's first line is), 3, 6 and 7; none
    with log_every 0."""
    from bdh_train.storage.run_dir import RunDir
    from bdh_train.train.metrics import MetricsConfig, MetricsReporter

    def logged(every: int) -> list[int]:
        reporter = MetricsReporter(
            RunDir(tmp_path), MetricsConfig(), enabled=False, log_every=every, last_step=7
        )
        return [step for step in range(1, 8) if reporter.should_log(step)]

    assert logged(3) == [1, 3, 6, 7]
    assert logged(1) == [1, 2, 3, 4, 5, 6, 7]
    assert logged(0) == []
