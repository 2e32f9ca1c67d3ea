"""What grow, merge and import-official share: a source read (a run directory or
checkpoint, through `load_run`), its finite-weights check, the fine-tune recipe a grown or
merged run trains on with, and `write_composed`.

The output directory holds model.safetensors, a config.toml (the first source's run config
with the new model section and `checkpoint.init_from` naming the directory, so
`bdh-train train --config OUT/config.toml` trains on from it), the source's tokenizer.json
when it has one, a merge's metrics.jsonl (its report and fine-tune losses) and a manifest. It
is written beside its final path and renamed into place, so a refusal or a crash leaves
nothing. No optimizer state is carried: the run that trains on starts a fresh optimizer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bdh_train.config import RunConfig, dump_toml
from bdh_train.data.tokenizer import TOKENIZER_FILE, HFTokenizer, Tokenizer
from bdh_train.errors import ConfigError
from bdh_train.model import BDH
from bdh_train.model.sampling import NonFiniteModelError, nonfinite_weights
from bdh_train.shared.loading import load_run
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage.output import check_output, writing
from bdh_train.storage.run_dir import CONFIG_FILE, METRICS_FILE
from bdh_train.train.optim import OptimizerConfig


@dataclass
class Source:
    """One loaded source run: its model, tokenizer and run config."""

    path: str
    model: BDH
    tokenizer: Tokenizer | None
    cfg: RunConfig


def load_source(path: str) -> Source:
    model, tokenizer, cfg = load_run(path)
    check_finite(model, f"the source {path}", "pass a checkpoint whose weights are finite")
    return Source(path, model, tokenizer, cfg)


def check_finite(model: BDH, what: str, fix: str) -> None:
    """NonFiniteModelError when `model`'s weights hold NaN or infinity: a model composed of
    them (or written from them) computes NaN."""
    bad = nonfinite_weights(model)
    if bad is not None:
        raise NonFiniteModelError(
            f"the weights of {what} are not finite: NaN or infinity in {bad}; nothing was "
            f"written: {fix}"
        )


def source_tokenizer_text(source: Source) -> str | None:
    """The tokenizer.json text of a source's own tokenizer (None for bytes or none)."""
    tok = source.tokenizer
    return tok.to_json() if isinstance(tok, HFTokenizer) else None


def check_out(out: str | Path) -> Path:
    """--out under the output policy: a new path, outside every checkpoint and run's files."""
    check_output(out, "--out", ConfigError, force=None, directory=True)
    return Path(out)


FINETUNE_WARMUP_STEPS = 10
"""The warm-up of a composed model's fine-tune recipe (`finetune_recipe`)."""


def finetune_recipe(optimizer: OptimizerConfig, max_steps: int) -> OptimizerConfig:
    """The optimizer a run that trains on a grown or merged model starts with: the lr the
    source's schedule ended at (its last step's, to 3 significant digits; a tenth of a
    constant lr), held constant after a warm-up of FINETUNE_WARMUP_STEPS (the new optimizer's
    moments are empty). The source's own schedule would warm the trained model back up to
    the peak rate it had decayed away from, and its loss would rise for tens of steps."""
    if optimizer.schedule == "constant":
        lr = optimizer.lr / 10
    else:
        lr = optimizer.lr_at(max_steps - 1, max_steps)
    return dataclasses.replace(
        optimizer,
        lr=float(f"{lr:.3g}"),
        schedule="constant",
        warmup_steps=FINETUNE_WARMUP_STEPS,
        min_lr=0.0,
    )


def describe_recipe(optimizer: OptimizerConfig) -> str:
    """The fine-tune recipe of a composed model's config, in words."""
    o = optimizer
    return f"lr {o.lr:.3g} ({o.schedule}) after {o.warmup_steps} warm-up steps"


def write_composed(
    out: Path,
    model: BDH,
    source: Source,
    rows: list[dict[str, Any]] | None = None,
    command: str = "merge",
) -> Path:
    """Write `model` as the checkpoint directory `out` (this module's docstring), with the
    run config and tokenizer of `source`, atomically."""
    check_finite(model, f"the model for {out}", "a fine-tune diverged: use fewer --finetune-steps")
    tokenizer_text = source_tokenizer_text(source)
    final = out.resolve()
    data = source.cfg.data
    if tokenizer_text is not None:
        data = dataclasses.replace(data, tokenizer=str(final / TOKENIZER_FILE))
    checkpoint = dataclasses.replace(source.cfg.checkpoint, init_from=str(final), resume="")
    cfg = dataclasses.replace(
        source.cfg,
        model=model.config,
        data=data,
        checkpoint=checkpoint,
        optimizer=finetune_recipe(source.cfg.optimizer, source.cfg.training.max_steps),
    )
    config = model.config.to_dict()
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}

    def write(directory: Path) -> None:
        from safetensors.torch import save_file

        metadata = ckpt.weights_metadata(config, 0)
        with writing(directory / ckpt.MODEL_FILE):
            save_file(tensors, str(directory / ckpt.MODEL_FILE), metadata=metadata)
        texts = {CONFIG_FILE: dump_toml(cfg)}
        if tokenizer_text is not None:
            texts[TOKENIZER_FILE] = tokenizer_text
        if rows is not None:
            texts[METRICS_FILE] = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
        for name, text in texts.items():
            with writing(directory / name):
                (directory / name).write_text(text, encoding="utf-8")

    return ckpt.publish_checkpoint_dir(out, write, command)
