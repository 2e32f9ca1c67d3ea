"""Loading official pathwaycom/bdh state_dicts."""

from __future__ import annotations

import pytest
import torch
from helpers import official_frequencies_buffer
from test_model_reference import spec_reference

from bdh_train.errors import CheckpointError
from bdh_train.model.official import load_official_checkpoint, load_official_state_dict


def official_state_dict(H=2, D=16, N=32, V=40):
    g = torch.Generator().manual_seed(3)
    return {
        "decoder": torch.randn(H * N, D, generator=g) * 0.02,
        "encoder": torch.randn(H, D, N, generator=g) * 0.02,
        "encoder_v": torch.randn(H, D, N, generator=g) * 0.02,
        "embed.weight": torch.randn(V, D, generator=g) * 0.02,
        "lm_head": torch.randn(D, V, generator=g) * 0.02,
        "attn.freqs": official_frequencies_buffer(N),
    }


def test_official_weights_give_the_spec_reference_logits():
    sd = official_state_dict()
    model = load_official_state_dict(sd, n_layer=3).double().eval()
    c = model.config
    assert (c.n_head, c.n_embd, c.n_neurons, c.vocab_size, c.mlp_internal_dim_multiplier) == (
        2,
        16,
        32,
        40,
        4,
    )
    assert (c.position, c.norm) == ("rope", "layernorm")
    idx = torch.randint(0, 40, (2, 7))
    logits, _ = model(idx)
    weights = {k: v.double() for k, v in sd.items()}
    ref, _ = spec_reference(weights, idx, 3, "rope")
    assert (logits - ref).abs().max().item() < 1e-10


def test_checkpoint_file_round_trip(tmp_path):
    path = tmp_path / "official.pt"
    torch.save(official_state_dict(), path)
    model = load_official_checkpoint(path, n_layer=2)
    assert torch.equal(model.encoder, official_state_dict()["encoder"])


def test_wrong_shape_names_the_key():
    sd = official_state_dict()
    sd["lm_head"] = torch.zeros(16, 41)
    with pytest.raises(CheckpointError, match=r"lm_head: expected \[16, 40\], got \[16, 41\]"):
        load_official_state_dict(sd, n_layer=2)


def test_missing_and_unexpected_keys_are_listed():
    sd = official_state_dict()
    del sd["encoder_v"]
    sd["extra"] = torch.zeros(1)
    with pytest.raises(
        CheckpointError,
        match=r"missing keys \['encoder_v'\].*unexpected keys "
        r"\['extra'\]",
    ):
        load_official_state_dict(sd, n_layer=2)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_official_checkpoint(tmp_path / "nope.pt", n_layer=2)


def test_import_official_writes_a_checkpoint_directory_the_commands_read(tmp_path, capsys):
    """`bdh-train import-official FILE --n-layer L --out DIR`: DIR's model gives the official
    weights' logits exactly, generate reads it with the byte tokenizer, and a bad file is one
    error line that writes nothing."""
    from bdh_train.cli import main
    from bdh_train.shared.loading import load_run

    sd = official_state_dict(V=256)
    path = tmp_path / "official.pt"
    torch.save(sd, path)
    out = tmp_path / "imported"
    assert main(["import-official", str(path), "--n-layer", "2", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"imported: {out}")
    model, tokenizer, cfg = load_run(out)
    assert tokenizer is not None and tokenizer.vocab_size == 256 and cfg.model == model.config
    idx = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], load_official_state_dict(sd, n_layer=2).eval()(idx)[0])
    assert (
        main(["generate", "--checkpoint", str(out), "--max-new-tokens", "4", "--prompt", "a"]) == 0
    )
    assert capsys.readouterr().out.startswith("a")
    bad = tmp_path / "bad.pt"
    torch.save({"encoder": sd["encoder"]}, bad)
    assert main(["import-official", str(bad), "--n-layer", "2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not an official BDH state_dict") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt", "imported", "official.pt"]
