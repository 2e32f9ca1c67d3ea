"""Summary memory end to end: a streamed TBPTT run with a write trigger resumes bit for bit
(the carry is checkpointed with the state, the mask adds nothing to the loader state) and
says once where its chunks differ from call-aligned chunking."""

from __future__ import annotations

import io

import torch
from safetensors.torch import load_file

from bdh_train.config import load_config
from bdh_train.storage import checkpoint as ckpt
from bdh_train.train.metrics import read_metrics
from bdh_train.training.trainer import Trainer

SUMMARY_STREAMING = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=4",
    "model.summary_memory.enabled=true",
    "model.summary_memory.chunk_tokens=4",
    "model.summary_memory.write_gate=true",
    "model.summary_memory.surprise_gate_threshold=0.2",
    "data.summary_write_trigger_text=' t'",
    "training.block_size=10",
    "training.batch_size=4",
    "training.tbptt_chunk_size=3",
    "training.tbptt_persist_across_steps=true",
    "training.min_logical_block_size=30",
    "training.log_every=1",
    "training.eval_every=4",
    "training.eval_steps=2",
    "training.checkpoint_every=4",
    "training.keep_checkpoints=0",
    "training.max_steps=8",
]


def test_summary_memory_run_resumes_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "sample", lambda self, *args, **kwargs: None)  # not under test
    whole_log = io.StringIO()
    whole = Trainer(load_config(overrides=SUMMARY_STREAMING), tmp_path / "whole", stream=whole_log)
    whole.run()
    carried = whole.executor.carried_state
    assert all(c is not None and c.memory.any() for c in carried.summary)  # some row wrote
    assert "note: training.tbptt_chunk_size (3) is not a multiple" in whole_log.getvalue()
    assert "note: training.block_size (10) is not a multiple" in whole_log.getvalue()

    split = tmp_path / "split"
    first = Trainer(load_config(overrides=SUMMARY_STREAMING), split, stream=io.StringIO())
    assert first.run(stop_after_micro_steps=5).stopped_early
    Trainer(
        load_config(overrides=SUMMARY_STREAMING), split, resume=True, stream=io.StringIO()
    ).run()
    a = load_file(str(ckpt.resolve_checkpoint(tmp_path / "whole") / ckpt.MODEL_FILE))
    b = load_file(str(ckpt.resolve_checkpoint(split) / ckpt.MODEL_FILE))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    keys = ("step", "loss", "grad_norm", "val_loss")
    rows = [
        [{k: v for k, v in r.items() if k in keys} for r in read_metrics(d / "metrics.jsonl")]
        for d in (tmp_path / "whole", split)
    ]
    assert rows[0] == rows[1]
