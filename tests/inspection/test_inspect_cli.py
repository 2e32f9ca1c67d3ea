"""`bdh-train inspect` end to end on a micro run: the report directory, the activity the
training's evaluations record (without changing training), bad input refused with one line
and nothing written, and report.html loaded in headless Chromium from file:// (no request
leaves the file; every image renders)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    DETERMINISTIC_METRICS,
    MICRO_RUN,
    checkpoint_weights,
    metric_rows,
    set_args,
    tiny_model,
)

from bdh_train.cli import main
from bdh_train.errors import BDHTrainError
from bdh_train.inspect.analysis import InspectOptions, inspect_model, write_report
from bdh_train.train.metrics import read_metrics

RUN = [*MICRO_RUN, "training.max_steps=2", "training.eval_every=1", "training.eval_steps=1"]
ACTIVITY = ("x_active", "y_active", "xy_active", "dead", "always_on")
PROMPTS = [
    {"prompt": "the dollar and the euro", "concept": True},
    {"prompt": "a cat on a mat", "concept": False},
    {"prompt": "yen, pounds and francs", "concept": True},
    {"prompt": "green <trees> & grass", "concept": False},
    {"prompt": "a shilling", "concept": True},
    {"prompt": "rain", "concept": False},
    {"prompt": "ten marks", "concept": True},
    {"prompt": "the sea", "concept": False},
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run")
    assert main(["train", "--run-dir", str(path), *set_args(RUN)]) == 0
    return path


def _prompts_file(path: Path, prompts: list[dict]) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


def _inspect(run_dir: Path, out: Path, *extra: str) -> int:
    args = ["inspect", "--checkpoint", str(run_dir), "--device", "cpu", "--out", str(out)]
    return main([*args, "--max-tokens", "300", *extra])


@pytest.fixture(scope="module")
def report(run_dir, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("report")
    prompts = _prompts_file(base / "prompts.jsonl", PROMPTS)
    assert _inspect(run_dir, base / "out", "--prompts", str(prompts)) == 0
    return base / "out"


def test_recording_activity_leaves_training_unchanged(run_dir, tmp_path):
    plain = tmp_path / "plain"
    args = set_args([*RUN, "training.eval_activity=false"])
    assert main(["train", "--run-dir", str(plain), *args]) == 0
    assert metric_rows(run_dir) == metric_rows(plain)
    assert {k: v.tolist() for k, v in checkpoint_weights(run_dir).items()} == {
        k: v.tolist() for k, v in checkpoint_weights(plain).items()
    }
    with_activity = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    without = [r for r in read_metrics(plain / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in with_activity] == [1, 2]
    for row, bare in zip(with_activity, without, strict=True):
        assert all(0 <= row[k] <= 1 and 0 <= row[f"{k}_l1"] <= 1 for k in ACTIVITY)
        assert row["x_active"] == pytest.approx((row["x_active_l0"] + row["x_active_l1"]) / 2)
        assert set(bare) <= set(DETERMINISTIC_METRICS) | {"step"}
    assert main(["plot", str(run_dir)]) == 0


def test_inspect_writes_the_report_and_its_numbers(report):
    names = sorted(p.name for p in report.iterdir())
    graphml = [f"hubs_G{k}_head{h}.graphml" for k in "xy" for h in (0, 1)]
    assert names == sorted(["inspect.json", "report.html", *graphml])
    numbers = json.loads((report / "inspect.json").read_text())
    assert numbers["tokens"] == 300 and numbers["position"] == "alibi_slow"  # the preset's
    sparsity = numbers["sparsity"]
    for key in ("x", "y", "xy", "dead", "always_on"):
        layers = [layer[key] for layer in sparsity["layers"]]
        assert sparsity["all"][key] == pytest.approx(sum(layers) / len(layers), abs=1e-12)
        for layer in sparsity["layers"]:
            heads = [h[key] for h in layer["heads"]]
            assert layer[key] == pytest.approx(sum(heads) / len(heads), abs=1e-12)
    assert len(numbers["graphs"]) == 4 and len(numbers["neurons"]) == 12
    selectivity = [n["selectivity"] for n in numbers["neurons"]]
    assert selectivity == sorted(selectivity, reverse=True)
    assert all(n["firing_rate"] <= 0.5 for n in numbers["neurons"])
    assert all(n["firing_rate"] > 0.5 for n in numbers["always_on_neurons"]["neurons"])
    probe = numbers["synapses"]["probe"]
    assert probe["train_texts"] == [2, 2] and probe["held_out_texts"] == [2, 2]
    assert numbers["synapses"]["prompts"] == [p["prompt"] for p in PROMPTS]
    page = (report / "report.html").read_text()
    assert "<h3>prompt 4: <code>green &lt;trees&gt; &amp; grass</code></h3>" in page
    assert "<h3>prompt 0" not in page and "<trees>" not in page
    assert page.count('src="data:image/png;base64,') == 2
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", page)


@pytest.mark.parametrize(
    "case, message",
    [
        ("max_tokens_0", "--max-tokens must be >= 1, got 0"),
        ("empty_prompts", "no prompts; write one JSON object a line"),
        ("one_class", "the concept probe needs at least 4 prompts with the concept and 4"),
        ("no_tokenizer", "carries no text tokenizer, so its data and prompts cannot be read"),
        ("layer_99", "--layer 99 is not a layer of this model: it has 2 (0 to 1, or -1 to -2 "),
        ("layer_-3", "--layer -3 is not a layer of this model: it has 2 (0 to 1, or -1 to -2 "),
    ],
)
def test_bad_input_is_one_error_line_and_writes_nothing(
    run_dir, tmp_path, capsys, monkeypatch, case, message
):
    extra: list[str] = []
    if case == "max_tokens_0":
        extra = ["--max-tokens", "0"]
    elif case == "empty_prompts":
        extra = ["--prompts", str(_prompts_file(tmp_path / "p.jsonl", []))]
    elif case.startswith("layer_"):
        extra = ["--layer", case.removeprefix("layer_")]
    elif case == "one_class":
        same = [{"prompt": p["prompt"], "concept": True} for p in PROMPTS]
        extra = ["--prompts", str(_prompts_file(tmp_path / "p.jsonl", same))]
    else:  # a model whose checkpoint carries no tokenizer (not a byte model)
        monkeypatch.setattr("bdh_train.shared.loading.tokenizer_for", lambda config: None)
    before = sorted(tmp_path.iterdir())
    capsys.readouterr()
    assert _inspect(run_dir, tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert sorted(tmp_path.iterdir()) == before  # no report, no half-built directory


PROBE = """<script>
var violations = [];
document.addEventListener("securitypolicyviolation", function (e) {
  violations.push(e.violatedDirective + " " + e.blockedURI);
});
window.addEventListener("load", function () {
  setTimeout(function () {
    var pre = document.createElement("pre");
    pre.id = "probe";
    pre.textContent = JSON.stringify({
      violations: violations,
      resources: performance.getEntriesByType("resource").map(function (r) { return r.name; }),
      images: Array.prototype.map.call(document.images, function (i) {
        var box = i.getBoundingClientRect();
        return [i.complete, i.naturalWidth, i.naturalHeight, box.width, box.height];
      })
    });
    document.body.appendChild(pre);
  }, 200);
});
</script>"""

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--virtual-time-budget=5000",
    "--dump-dom",
]


def _load_in_chromium(chromium: str, page: str, directory: Path) -> dict:
    """What the probe script saw when Chromium loaded `page` from file://: the policy's
    violations (each blocked request), the resources fetched, each image's size."""
    # the copy differs only by the probe script, which its policy lets run inline
    page = page.replace("default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';")
    page = page.replace("</title>", "</title>" + PROBE, 1)
    path = directory / "probed.html"
    path.write_text(page)
    profile = directory / "profile"
    proc = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", path.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"no probe output from Chromium: {proc.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def test_the_report_loads_in_chromium_without_requests_and_its_images_render(report, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("skipped: no chromium on PATH (`make test` installs Debian's as root)")
        pytest.skip("no chromium on PATH: `apt-get install chromium` (make test does, as root)")
    page = (report / "report.html").read_text()
    seen = _load_in_chromium(chromium, page, tmp_path)
    assert seen["violations"] == [] and seen["resources"] == []
    assert len(seen["images"]) == 2
    for complete, width, height, shown_width, shown_height in seen["images"]:
        assert (
            complete and width > 100 and height > 100 and shown_width > 100 and shown_height > 100
        )
    # the probe sees a request: the same page with one image from the network is blocked
    leaky = page.replace("</body>", '<img src="http://example.invalid/x.png"></body>')
    seen = _load_in_chromium(chromium, leaky, tmp_path)
    assert seen["violations"] == ["img-src http://example.invalid/x.png"]


@pytest.fixture(scope="module")
def inspection():
    model = tiny_model(vocab_size=16)
    tokens = torch.randint(0, 16, (40,), generator=torch.Generator().manual_seed(0))
    options = InspectOptions(block_size=8, graph_neurons=16, edges_per_neuron=2, hubs=4)
    found = inspect_model(model, tokens, None, options)
    found.numbers |= {"checkpoint": "tiny", "data": "random ids"}
    return found


def test_the_report_directory_appears_whole_or_not_at_all(inspection, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert write_report(inspection, out, hubs=4) == out / "report.html"
    first = (out / "inspect.json").read_text()
    assert json.loads(first)["tokens"] == 40
    (out / "report.html").write_text("old")
    with pytest.raises(BDHTrainError, match="already exists; pass --force"):
        write_report(inspection, out, hubs=4)
    write_report(inspection, out, hubs=4, force=True)  # an earlier report is replaced whole
    assert (out / "report.html").read_text() != "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("bdh_train.inspect.analysis.write_hub_graphml", fail)
    with pytest.raises(BDHTrainError, match="cannot write .*No space left on device"):
        write_report(inspection, tmp_path / "new" / "deeper", hubs=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing half-built
    foreign = tmp_path / "mine"
    foreign.mkdir()
    with pytest.raises(BDHTrainError, match="is not an earlier inspect report"):
        write_report(inspection, foreign, hubs=4, force=True)
