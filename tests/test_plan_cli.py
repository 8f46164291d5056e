"""`ragged-optim plan`, run in-process through ragged_optim.cli.main."""

from __future__ import annotations

import json

import pytest

from ragged_optim.cli import main

KEYS = {
    "model",
    "world_size",
    "granularity",
    "total_elements",
    "padded_elements",
    "padding_ratio",
    "split_blocks",
    "split_bytes_ratio",
    "fsdp2_padding_ratio",
    "max_over_mean_load",
    "owner_compute_max_over_mean",
    "plan_seconds",
}


def _json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, "--json prints exactly one line"
    return json.loads(out)


@pytest.mark.parametrize(
    "model, W, G",
    [("llama3-8b", 8, 1), ("deepseek-v3", 128, 16), ("gpt-oss-20b", 64, 128), ("qwen3-30b-a3b", 3, 16)],
)
def test_json_keys_and_sanity(capsys, model, W, G):
    d = _json(capsys, "--model", model, "--world-size", str(W), "--granularity", str(G))
    assert set(d) == KEYS
    assert (d["model"], d["world_size"], d["granularity"]) == (model, W, G)
    assert d["total_elements"] > 10**9
    assert d["padded_elements"] >= 0
    assert d["padding_ratio"] == pytest.approx(d["padded_elements"] / d["total_elements"])
    assert 0 <= d["split_bytes_ratio"] < 1 and d["split_blocks"] >= 0
    assert d["fsdp2_padding_ratio"] >= 0
    assert d["max_over_mean_load"] >= 1.0
    assert d["owner_compute_max_over_mean"] is None
    assert 0 <= d["plan_seconds"] < 30


def test_parameter_counts_match_published_sizes(capsys):
    sizes = {"llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9, "deepseek-v3": 671e9}
    for model, n in sizes.items():
        d = _json(capsys, "--model", model, "--world-size", "8")
        assert d["total_elements"] == pytest.approx(n, rel=0.02), model


def test_muon_owner_compute_and_no_split(capsys):
    d = _json(capsys, "--model", "gpt-oss-20b", "--world-size", "16", "--granularity", "16", "--optimizer", "muon")
    assert d["owner_compute_max_over_mean"] is not None and d["owner_compute_max_over_mean"] >= 1.0
    d = _json(capsys, "--model", "llama3-8b", "--world-size", "16", "--granularity", "16", "--no-split")
    assert d["split_blocks"] == 0 and d["split_bytes_ratio"] == 0


@pytest.mark.parametrize("opt", ["shampoo", "adamw8bit"])
def test_other_optimizers(capsys, opt):
    d = _json(capsys, "--model", "llama3-8b", "--world-size", "32", "--granularity", "256", "--optimizer", opt)
    assert set(d) == KEYS


def test_table_output(capsys):
    assert main(["plan", "--model", "llama3-8b", "--world-size", "64", "--granularity", "16"]) == 0
    out = capsys.readouterr().out
    assert "padding" in out and "fsdp2 pad" in out and "all units" in out and "overhead" in out


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_module_factory(capsys):
    d = _json(capsys, "--module", "torch.nn:Transformer", "--world-size", "4", "--granularity", "8")
    assert d["model"] == "torch.nn:Transformer" and d["total_elements"] > 10**7


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_units_from_module_rule():
    import torch
    from torch import nn

    from ragged_optim.sharding.catalog import units_from_module

    with torch.device("meta"):
        m = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=64)
    units = units_from_module(m)
    assert [u.name for u in units] == ["decoder.layers.0", "decoder.layers.1", "decoder.layers.2", "root"]
    assert sum(u.numel for u in units) == sum(p.numel() for p in m.parameters())
    assert any(n.startswith("encoder.layers.1.") for n, _ in units[-1].params)


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["plan", "--model", "llama9", "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'llama9'" in err and "deepseek-v3" in err and "llama3-70b" in err
    assert "Traceback" not in err


def test_bad_arguments(capsys):
    assert main(["plan", "--model", "llama3-8b", "--world-size", "0"]) == 2
    assert "--world-size must be >= 1" in capsys.readouterr().err
    assert main(["plan", "--world-size", "8"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--world-size", "8", "--alignment", "24"]) == 2
    assert "alignment must be a power of two" in capsys.readouterr().err
    assert main(["plan", "--module", "no_such_pkg_xyz:f", "--world-size", "8"]) == 2
    assert "no_such_pkg_xyz" in capsys.readouterr().err
