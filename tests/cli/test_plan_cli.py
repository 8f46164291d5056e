"""`ragged-optim plan`, run in-process through ragged_optim.cli.main."""

from __future__ import annotations

import json
import math

import pytest

from ragged_optim import plan_cmd
from ragged_optim.cli import main
from ragged_optim.sharding.catalog import model_units
from ragged_optim.sharding.layout import BlockSpec

KEYS = {
    "model",
    "world_size",
    "tp",
    "ep",
    "granularity",
    "total_elements",
    "padded_elements",
    "padding_ratio",
    "split_blocks",
    "split_bytes_ratio",
    "owner_blocks",
    "owner_cut_blocks",
    "owner_moved_blocks",
    "owner_moved_bytes_ratio",
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


def _fsdp2_row_band_padding(model: str, W: int, G: int) -> int:
    """FSDP2 Shard(0) padding for G-row bands (the default specs), from the rule in plan_cmd's docstring: dim 0 of
    a matrix padded to a multiple of W * G rows, a 1-D tensor to W runs of G elements, a 3-D expert stack to a
    multiple of W slices."""
    pad = 0
    for unit in model_units(model):
        for _, shape in unit.params:
            d0, rest = shape[0], math.prod(shape[1:])
            if len(shape) == 1:
                mult = W * min(G, d0)  # a tensor shorter than G is one run
            elif len(shape) == 2:
                mult = W * G if G < d0 else W  # G >= rows: one whole-matrix block, Shard(0) pads to W only
            else:
                mult = W
            pad += (-d0 % mult) * rest
    return pad


@pytest.mark.parametrize(
    "model, W, G",
    [("llama3-8b", 8, 1), ("deepseek-v3", 128, 16), ("gpt-oss-20b", 64, 128), ("qwen3-30b-a3b", 3, 16)],
)
def test_json_keys_and_sanity(capsys, model, W, G):
    d = _json(capsys, "--model", model, "--world-size", str(W), "--granularity", str(G))
    assert set(d) == KEYS
    assert (d["model"], d["world_size"], d["granularity"]) == (model, W, G)
    assert d["total_elements"] > 10**9
    # Padding fills each unit to W equal shards of a 16-byte multiple (4 fp32 elements).
    assert (d["total_elements"] + d["padded_elements"]) % (W * 4) == 0
    assert d["padding_ratio"] == pytest.approx(d["padded_elements"] / d["total_elements"])
    # A rank holds at most its shards, so the heaviest rank carries at most mean * (1 + padding).
    assert 1.0 <= d["max_over_mean_load"] <= 1 + d["padding_ratio"] + 1e-12
    # Each of a unit's W - 1 shard boundaries cuts at most one block; split bytes exist iff split blocks do.
    assert d["split_blocks"] <= (W - 1) * len(model_units(model))
    assert (d["split_blocks"] == 0) == (d["split_bytes_ratio"] == 0) and d["split_bytes_ratio"] < 1
    fsdp2 = _fsdp2_row_band_padding(model, W, G)
    assert d["fsdp2_padding_ratio"] == pytest.approx(fsdp2 / d["total_elements"], rel=1e-12, abs=0)
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


@pytest.mark.parametrize("opt", ["shampoo", "soap", "adamw8bit"])
def test_other_optimizers(capsys, monkeypatch, opt):
    seen = set()
    real = plan_cmd.block_spec
    monkeypatch.setattr(plan_cmd, "block_spec", lambda n, s, g, o: seen.add(o) or real(n, s, g, o))
    argv = ("--model", "llama3-8b", "--world-size", "32", "--granularity", "256")
    d = _json(capsys, *argv, "--optimizer", opt)
    assert set(d) == KEYS and seen == {opt}  # the flag reaches the block specs
    base = _json(capsys, *argv)  # no --optimizer: G-row bands
    drop = {"plan_seconds"}
    n = 4096 * 4096
    if opt in ("shampoo", "soap"):
        # Shampoo and SOAP ask for the same G-row bands as the default, so the plan is the same.
        assert real("w", (4096, 4096), 256, opt) == BlockSpec(block=256 * 4096, period=n)
        assert {k: v for k, v in d.items() if k not in drop} == {k: v for k, v in base.items() if k not in drop}
    else:
        # 256-element quantization runs: far finer than 256-row bands of 4096-wide matrices.
        assert real("w", (4096, 4096), 256, opt) == BlockSpec(block=256, period=n)
        assert d["padding_ratio"] < 0.001 and base["padding_ratio"] > 0.05
        assert d["max_over_mean_load"] < base["max_over_mean_load"]
        # FSDP2 then pads only the 65 RMSNorm weights (4096 elements) to W * 256 elements; every matrix has a
        # multiple of W rows.
        assert d["fsdp2_padding_ratio"] == pytest.approx(65 * (32 * 256 - 4096) / d["total_elements"], rel=1e-12)
        assert base["fsdp2_padding_ratio"] > 0.5


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
    assert _exit_code(["plan", "--model", "llama9", "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'llama9'" in err and "deepseek-v3" in err and "llama3-70b" in err
    assert "Traceback" not in err


def test_bad_arguments(capsys):
    assert _exit_code(["plan", "--model", "llama3-8b", "--world-size", "0"]) == 2
    assert "--world-size must be >= 1" in capsys.readouterr().err
    assert _exit_code(["plan", "--world-size", "8"]) == 2
    assert "--model" in capsys.readouterr().err
    assert _exit_code(["plan", "--model", "llama3-8b", "--world-size", "8", "--alignment", "24"]) == 2
    assert "alignment must be a power of two" in capsys.readouterr().err
    assert _exit_code(["plan", "--module", "no_such_pkg_xyz:f", "--world-size", "8"]) == 2
    assert "no_such_pkg_xyz" in capsys.readouterr().err
    # (before: "tensor 'layers.0.self_attn.q_proj.weight': itemsize must be ...", naming a tensor, not the flag)
    assert _exit_code(["plan", "--model", "llama3-8b", "--world-size", "8", "--itemsize", "0"]) == 2
    assert "--itemsize must be >= 1 (bytes per element), got 0" in capsys.readouterr().err


def test_muon_plan_counts_cut_and_moved_matrices(capsys):
    """DeepSeek-V3 at W = 8 for Muon: rank boundaries cut expert matrices and the owner balance moves some whole
    ones. The summary counts them with the final (jointly balanced) owners, the same figures as counting each
    matrix of the returned layouts. Before the fix the stats skipped owner-computed specs (no owner_* keys) and
    the table read 0 split bytes."""
    s = plan_cmd.plan_model("deepseek-v3", 8, granularity=16, optimizer="muon", return_layouts=True)
    cut = moved = 0
    for _unit, layout in s["_units"]:
        for i, (spec, blocks) in enumerate(zip(layout.specs, layout.owned_blocks)):
            if spec.owner_computed:
                for b in blocks:
                    ranks = list(layout.ranks_of(i, b.start, b.end))
                    cut += len(ranks) > 1
                    moved += ranks != [b.owner]
    assert s["owner_cut_blocks"] == cut > 0
    assert s["owner_moved_blocks"] == moved >= cut
    assert 0 < s["owner_moved_bytes_ratio"] < 1
    assert s["owner_blocks"] > 256 * 3 * 58  # every expert matrix of the 58 MoE layers is an owner-computed block
    assert sum(r["owner_moved_blocks"] for r in s["_rows"]) == moved
    assert (
        main(["plan", "--model", "deepseek-v3", "--world-size", "8", "--granularity", "16", "--optimizer", "muon"]) == 0
    )
    out = capsys.readouterr().out
    assert f"{cut} cut by a rank boundary, {moved} computed on a rank that does not hold them whole" in out


def test_plan_model_is_the_cli_in_python(capsys):
    """The Python entry gives what `plan --json` prints; bad arguments name the parameter."""
    d = _json(capsys, "--model", "gpt-oss-20b", "--world-size", "6", "--granularity", "16", "--optimizer", "muon")
    s = plan_cmd.plan_model("gpt-oss-20b", 6, granularity=16, optimizer="muon")
    drop = {"plan_seconds"}
    assert {k: v for k, v in s.items() if not k.startswith("_") and k not in drop} == {
        k: v for k, v in d.items() if k not in drop
    }
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        plan_cmd.plan_model("llama3-8b", 0)
    with pytest.raises(ValueError, match="granularity must be an int >= 1"):
        plan_cmd.plan_model("llama3-8b", 8, granularity=0)
    with pytest.raises(ValueError, match="optimizer must be None or one of muon, shampoo, soap, adamw8bit"):
        plan_cmd.plan_model("llama3-8b", 8, optimizer="sgd")
    with pytest.raises(ValueError, match="model must be a catalog model name"):
        plan_cmd.plan_model(42, 8)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_plan_model_takes_a_module(capsys):
    """An nn.Module built on meta plans as `--module pkg.mod:factory` does (the same factory)."""
    import torch
    from torch import nn

    d = _json(capsys, "--module", "torch.nn:Transformer", "--world-size", "4", "--granularity", "8")
    with torch.device("meta"):
        m = nn.Transformer()
    s = plan_cmd.plan_model(m, 4, granularity=8)
    assert s["model"] == "Transformer" and d["model"] == "torch.nn:Transformer"
    drop = {"plan_seconds", "model"}
    assert {k: v for k, v in s.items() if not k.startswith("_") and k not in drop} == {
        k: v for k, v in d.items() if k not in drop
    }


def _exit_code(argv) -> int:
    """``main``'s exit status: a usage error exits through argparse (usage line, ``ragged-optim plan: error: ...``)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_tensor_and_expert_parallel_plans():
    """`plan --tp N` plans TP-local shapes over W / tp ranks, `--ep N` expert stacks of E / ep experts over W / ep
    ranks (on main: no such options)."""
    from ragged_optim.sharding.catalog import model_units

    full = plan_cmd.plan_model("llama3-8b", 8, granularity=16)
    tp = plan_cmd.plan_model("llama3-8b", 16, tp=2, granularity=16)
    replicated = sum(math.prod(s) for u in model_units("llama3-8b") for _, s in u.params if len(s) == 1)
    assert tp["total_elements"] == (full["total_elements"] - replicated) // 2 + replicated
    assert all(row["ranks"] == 8 for row in tp["_rows"]) and tp["tp"] == 2
    units = dict(plan_cmd.parallel_units(model_units("llama3-8b"), 16, tp=2))
    layer = dict(next(u for u in units if u.name == "layers.0").params)
    assert layer["layers.0.self_attn.q_proj.weight"] == (2048, 4096)  # column-wise: rows / tp
    assert layer["layers.0.self_attn.o_proj.weight"] == (4096, 2048)  # row-wise: columns / tp
    assert layer["layers.0.input_layernorm.weight"] == (4096,)  # replicated
    ep = plan_cmd.plan_model("deepseek-v3", 64, ep=8, granularity=16, optimizer="muon")
    experts = [row for row in ep["_rows"] if row["unit"].endswith(".experts")]
    assert experts and all(row["ranks"] == 8 for row in experts)
    assert all(row["ranks"] == 64 for row in ep["_rows"] if not row["unit"].endswith(".experts"))
    stacked = sum(math.prod(s) for u in model_units("deepseek-v3") for _, s in u.params if len(s) == 3)
    dense = plan_cmd.plan_model("deepseek-v3", 64, granularity=16)["total_elements"] - stacked
    assert ep["total_elements"] == dense + stacked // 8
    for big in (("llama3-70b", 1024, {"tp": 8}), ("deepseek-v3", 2048, {"ep": 64})):
        assert plan_cmd.plan_model(big[0], big[1], granularity=16, optimizer="muon", **big[2])["plan_seconds"] < 1.0


def test_tensor_and_expert_parallel_bad_sizes_are_named(capsys):
    for argv, want in (
        (["--world-size", "12", "--tp", "5"], "tp must be an int >= 1 that divides world_size=12"),
        (["--world-size", "16", "--tp", "2", "--ep", "2"], "not modelled"),
    ):
        with pytest.raises(SystemExit):
            main(["plan", "--model", "llama3-8b", *argv])
        assert want in capsys.readouterr().err
    with pytest.raises(ValueError, match="experts do not divide over ep=3"):
        plan_cmd.plan_model("deepseek-v3", 6, ep=3)
