"""Benchmarks at tiny sizes on 2 ranks: keys, sanity, parity; the CLI prints one JSON object."""

import functools
import json
import math

import pytest
import torch
from bench_keys import assert_keys_documented
from noise_bounds import assert_within_reference

from ragged_optim.bench import cli as bench_cli
from ragged_optim.cli import main

FSDP_KEYS = {
    "ours_step_s",
    "fsdp2_step_s",
    "step_time_ratio",
    "ours_collectives_per_step",
    "fsdp2_collectives_per_step",
    "ours_bytes_per_step",
    "fsdp2_bytes_per_step",
    "param_max_abs_diff_vs_single",
    "step_time_ratio_ac",
    "param_max_abs_diff_vs_single_ac",
}
MUON_KEYS = {
    "ours_opt_step_s",
    "torch_muon_fsdp2_opt_step_s",
    "speedup",
    "ours_collectives_per_step",
    "torch_collectives_per_step",
    "ours_bytes_per_step",
    "torch_bytes_per_step",
    "owner_compute_max_over_mean",
    "max_rel_diff_vs_unsharded",
    "torch_status",
    "ours_native_ns_opt_step_s",
    "speedup_same_ns_matmul",
    "ours_ns_matmul",
}


@pytest.fixture(scope="module")
def fsdp_result():
    from ragged_optim.bench.fsdp import run

    return run(world_size=2, steps=1, preset="tiny", n_layers=2, seq_len=32)


@pytest.fixture(scope="module")
def muon_result():
    from ragged_optim.bench.muon import run

    return run(world_size=2, steps=1, scale=16)


def test_tp_bench_keys_and_parity():
    """`bench tp` at a tiny size: FSDP x TP on a (2, 2) mesh, ours and FSDP2 + TP as close to one process as each
    other, with the same collectives (on main: no such benchmark, and fully_shard refused the TP params)."""
    from ragged_optim.bench.tp import run

    r = run(world_size=4, steps=1, preset="tiny", seq_len=32, muon=False)  # (its Muon part: the test below)
    assert_keys_documented("tp", r)
    assert r["mesh"] == {"dp": 2, "tp": 2} and r["ranks_agree_on_counts"]
    assert r["ours_comm"]["calls"] == r["fsdp2_comm"]["calls"] and r["bytes_ratio"] <= 1.0
    assert_within_reference(
        r["param_max_abs_diff_vs_single"], r["fsdp2_param_max_abs_diff_vs_single"], 1.0, "bench tp vs one process"
    )


def test_fsdp_keys_and_sanity(fsdp_result):
    r = fsdp_result
    assert FSDP_KEYS <= r.keys()
    assert_keys_documented("fsdp", r)
    assert r["ours_step_s"] > 0 and r["fsdp2_step_s"] > 0
    assert math.isclose(r["step_time_ratio"], r["ours_step_s"] / r["fsdp2_step_s"])
    assert r["ours_collectives_per_step"] > 0 and r["fsdp2_collectives_per_step"] > 0
    assert r["ours_bytes_per_step"] > 0 and r["fsdp2_bytes_per_step"] > 0
    # one all-gather per unit forward (3 units), one per non-root unit backward, one reduce-scatter per unit
    assert r["ours_comm"]["calls"] == {"all_gather": 5, "reduce_scatter": 3}
    assert r["ours_bytes_per_step"] <= r["fsdp2_bytes_per_step"]
    assert r["ranks_agree_on_counts"]
    # both FSDPs sum the same grads in gloo's order: FSDP2's distance, measured in the same run, bounds ours
    # (plus 4 float32 ulps of 1.0, above the params' magnitude, in case FSDP2 rounds exactly as one process)
    assert_within_reference(
        r["param_max_abs_diff_vs_single"], r["fsdp2_param_max_abs_diff_vs_single"], 1.0, "bench fsdp vs one process"
    )
    # activation checkpointing recomputes the same values: the same params as without it, on both sides
    assert r["param_max_abs_diff_vs_single_ac"] == r["param_max_abs_diff_vs_single"]
    assert r["fsdp2_param_max_abs_diff_vs_single_ac"] == r["fsdp2_param_max_abs_diff_vs_single"]
    assert math.isclose(r["step_time_ratio_ac"], r["ours_step_s_ac"] / r["fsdp2_step_s_ac"])


def test_muon_keys_and_sanity(muon_result):
    r = muon_result
    assert MUON_KEYS <= r.keys()
    assert_keys_documented("muon", r)
    assert r["ours_opt_step_s"] > 0 and r["torch_muon_fsdp2_opt_step_s"] > 0
    # torch 2.13 (the pinned dev version) runs torch.optim.Muon on DTensors; a later torch that cannot would
    # report a one-line error here and fall back to _GatherFullMuon.
    assert r["torch_status"] == "ok" or not torch.__version__.startswith("2.13"), r["torch_status"]
    assert 0 < r["ours_collectives_per_step"] <= 2 * r["units_with_muon_params"]
    assert r["torch_collectives_per_step"] > 0
    assert r["ours_ns_matmul"] in ("native", "upcast")
    assert math.isclose(r["speedup_same_ns_matmul"], r["torch_muon_fsdp2_opt_step_s"] / r["ours_native_ns_opt_step_s"])
    assert 0 < r["ours_bytes_per_step"]
    assert r["ours_bytes_over_shard_wire_max"] <= 2.0
    assert 1.0 <= r["owner_compute_max_over_mean"] <= 1.5
    # fp32 Newton-Schulz, same math as one process; the grads differ by sum order: bounded by the one-process run's
    # own gap between two batchings, measured in the same run
    assert_within_reference(
        r["max_rel_diff_vs_unsharded"], r["unsharded_batching_rel_diff"], 1.0, "bench muon vs one process"
    )
    # bf16 Newton-Schulz is not compared: last-bit grad differences (gloo's sum order) flip bf16 roundings, and
    # over a few steps that reaches ~0.2 of the update even between two one-process runs (docs/benchmarks.md).
    assert math.isfinite(r["max_rel_diff_vs_unsharded_bfloat16"])


def test_cli_json_prints_one_object(monkeypatch, capsys):
    from ragged_optim.bench import muon

    monkeypatch.setattr(muon, "run", functools.partial(muon.run, scale=16, compare_single=False))
    assert main(["bench", "muon", "--world-size", "2", "--steps", "1", "--json"]) == 0
    out = capsys.readouterr().out
    obj = json.loads(out)  # exactly one JSON document: extra output would make this raise
    assert isinstance(obj, dict) and obj["world_size"] == 2 and obj["timed_steps"] == 1
    assert out.strip().count("\n") == 0


_PEERS_RESULT = {
    "families": {
        "adamw8bit": {
            "ro.AdamW8bit": {
                "status": "ok",
                "val_loss_mean": 2.5,
                "val_loss_spread": 0.1,
                "step_time_ratio_ours_over_this": 1.0,
                "state_bytes_per_param": 2.08,
                "max_step_over_lr": 1.16,
            }
        }
    },
    "adamw8bit_max_step_over_lr": 1.16,
}
_PEERS_ROW = "| adamw8bit: ro.AdamW8bit | 2.5000 ± 0.1000 | 1.00 | 2.08 | 1.16 |"


def test_cli_all_writes_json_and_markdown(monkeypatch, capsys, tmp_path):
    from ragged_optim.bench import fsdp, muon, peers

    monkeypatch.setattr(bench_cli, "available", lambda: ["fsdp", "muon", "peers"])
    monkeypatch.setattr(fsdp, "run", lambda world_size=4, **kw: {"step_time_ratio": 0.5, "world_size": world_size})
    monkeypatch.setattr(muon, "run", lambda world_size=4, **kw: {"speedup": 9.0, "steps": kw.get("steps")})
    monkeypatch.setattr(peers, "run", lambda world_size=None, steps=None, seeds=3: {**_PEERS_RESULT, "seeds": seeds})
    # --seeds goes to the benchmarks that take it (peers) and is dropped for the others
    rc = main(["bench", "all", "--world-size", "3", "--steps", "2", "--seeds", "1", "--json", "--out", str(tmp_path)])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    machine = obj.pop("machine")
    assert obj == {
        "fsdp": {"step_time_ratio": 0.5, "world_size": 3},
        "muon": {"speedup": 9.0, "steps": 2},
        "peers": {**_PEERS_RESULT, "seeds": 1},
    }
    assert json.loads((tmp_path / "latest.json").read_text()) == {"machine": machine, **obj}
    # what the figures were measured on: the CPU, its flags that matter, ATen's level, ns_matmul's choice
    assert {"cpu_model", "cpu_flags", "aten_cpu_capability", "ns_matmul_auto_bf16_cpu", "torch"} <= machine.keys()
    assert machine["ns_matmul_auto_bf16_cpu"] in ("native", "upcast")
    md = (tmp_path / "latest.md").read_text()
    assert "CPUs" in md and "torch" in md and "## fsdp" in md and "| speedup | 9 |" in md
    assert str(machine["cpu_model"]) in md and "ns_matmul=auto -> " + machine["ns_matmul_auto_bf16_cpu"] in md
    # peers' rows as their own table, not as one cell of nested dicts
    assert _PEERS_ROW in md and "| families |" not in md and "| adamw8bit_max_step_over_lr | 1.16 |" in md


def test_cpu_description_reads_the_flags_that_matter():
    """Before, bench all recorded only the CPU count (checked: this test failed on the import)."""
    from ragged_optim.bench.common import cpu_description

    info = "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse\n"
    d = cpu_description(info)
    assert d["cpu_flags"] == ["avx2", "avx512f", "avx512_bf16"]
    assert d["cpu_model"] == "AMD EPYC 9654"
    assert cpu_description("")["cpu_flags"] is None


def test_loss_ratios_are_means_over_seeds_with_their_spread():
    """Before: one seed, one ratio, no spread (checked: run() took no ``seeds``)."""
    from ragged_optim.bench import adamw8bit, comm

    c = comm.run(world_size=2, steps=2, preset="tiny", batch_size=4, seeds=2)
    assert_keys_documented("comm", c)
    for name in ("int8", "bf16"):
        stats = c[f"loss_ratio_{name}_vs_fp32_seeds"]
        assert len(stats["per_seed"]) == 2 and stats["per_seed"][0] != stats["per_seed"][1]
        assert c[f"loss_ratio_{name}_vs_fp32"] == pytest.approx(sum(stats["per_seed"]) / 2)
        assert c[f"loss_ratio_{name}_vs_fp32_seed_std"] == stats["seed_std"] > 0
    a = adamw8bit.run(world_size=2, steps=2, torchao=False, seeds=2)
    assert_keys_documented("adamw8bit", a)
    assert len(a["loss_ratio_vs_fp32_seeds"]["per_seed"]) == 2 and a["loss_ratio_vs_fp32_seed_std"] > 0


def test_cli_table_and_unknown(monkeypatch, capsys):
    from ragged_optim.bench import muon

    monkeypatch.setattr(muon, "run", lambda world_size=4, **kw: {"speedup": 7.25, "torch_status": "ok"})
    assert main(["bench", "muon"]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "7.25" in out
    from ragged_optim.bench import peers

    monkeypatch.setattr(peers, "run", lambda world_size=None, steps=None: dict(_PEERS_RESULT))
    assert main(["bench", "peers"]) == 0
    out = capsys.readouterr().out
    assert _PEERS_ROW in out and "families" not in out and "1.16" in out
    with pytest.raises(SystemExit):
        main(["bench", "nonesuch"])
    monkeypatch.setattr(bench_cli, "available", lambda: ["fsdp"])
    assert main(["bench", "muon"]) == 2


def test_peers_cli_json_with_a_missing_peer(monkeypatch, capsys):
    """`bench peers --json` on the AdamW8bit family, 2 steps, one seed: the required keys, our bounded step, and a
    peer that cannot be imported as a row with its reason (new with issue 18)."""
    from ragged_optim.bench import peers

    make = peers._make

    def without_torchao(row, model):
        if row == "torchao AdamW8bit":
            raise ImportError("No module named 'torchao'")
        return make(row, model)

    monkeypatch.setattr(peers, "_make", without_torchao)
    assert main(["bench", "peers", "--steps", "2", "--seeds", "2", "--families", "adamw8bit", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert_keys_documented("peers", obj)
    assert list(obj["families"]) == ["adamw8bit"] and obj["seeds"] == [0, 1]
    rows = obj["families"]["adamw8bit"]
    assert rows["torchao AdamW8bit"]["status"] == "ImportError: No module named 'torchao'"
    assert rows["ro.AdamW8bit"]["status"] == "ok" and rows["torch.optim.AdamW (fp32)"]["status"] == "ok"
    assert obj["steps"] == 2 and obj["adamw8bit_max_step_over_lr"] <= 2.0
    assert 0.9 < obj["adamw8bit_val_loss_ratio_vs_fp32"] < 1.1
    # each loss ratio with its per-seed values and the standard error of their mean
    fp32 = rows["torch.optim.AdamW (fp32)"]["val_loss_per_seed"]
    for key, row in (("adamw8bit", "ro.AdamW8bit"), ("adamw8bit_bnb", "bitsandbytes AdamW8bit")):
        if rows[row]["status"] != "ok":  # bitsandbytes is an optional peer
            continue
        ratios = [a / b for a, b in zip(rows[row]["val_loss_per_seed"], fp32)]
        assert obj[f"{key}_val_loss_ratio_vs_fp32_per_seed"] == pytest.approx(ratios, rel=1e-12)
        assert obj[f"{key}_val_loss_ratio_vs_fp32"] == pytest.approx((ratios[0] + ratios[1]) / 2, rel=1e-12)
        assert obj[f"{key}_val_loss_ratio_vs_fp32_stderr"] == pytest.approx(abs(ratios[0] - ratios[1]) / 2, rel=1e-9)
    assert rows["ro.AdamW8bit"]["state_bytes_per_param"] < rows["torch.optim.AdamW (fp32)"]["state_bytes_per_param"]
    assert "| adamw8bit: torchao AdamW8bit | not run: ImportError" in peers.markdown_table(obj)


def test_bench_seeds_and_families_misuse_is_named():
    from ragged_optim.bench import peers
    from ragged_optim.bench.cli import run_benchmark

    with pytest.raises(ValueError, match=r"benchmark 'muon' takes no --families \(it is for: peers\)"):
        run_benchmark("muon", families=["muon"])
    with pytest.raises(ValueError, match=r"benchmark 'fsdp' takes no --seeds \(it is for: adamw8bit, comm, peers\)"):
        run_benchmark("fsdp", seeds=2)
    with pytest.raises(ValueError, match=r"unknown families \['adam'\]; choose from \['muon', 'adamw8bit'"):
        peers.run(steps=1, families=["adam"])
    with pytest.raises(ValueError, match="seeds must name at least one seed"):
        peers.run(steps=1, seeds=0)


def test_memory_bench_keys_and_what_it_counts():
    """bench memory at a tiny size: every key, and the bytes alive when step 2 starts (shards + AdamW state, grads
    freed by zero_grad) equal FSDP2's up to its padding: the measure sees what is alive, not only what moves. The
    peak is the exact count's (profiler figures beside it), with the phase it fell in and the sites live then."""
    from ragged_optim.bench.memory import CONFIGS, PHASES, run

    r = run(world_size=2, preset="tiny", also_presets=("small",), configs=("adamw",))
    assert_keys_documented("memory", r)
    assert r["small"]["preset"] == "small" and r["small"]["params"] > r["params"]
    assert r["peak_ratio_vs_fsdp2_adamw_small"] == r["small"]["peak_ratio_vs_fsdp2_adamw"] > 0
    assert CONFIGS == ("adamw", "muon", "adamw_ac")
    for key in ("ours_peak_bytes_adamw", "fsdp2_peak_bytes_adamw", "peak_ratio_vs_fsdp2_adamw", "init_peak_bytes"):
        assert r[key] > 0, key
    for side in ("ours", "fsdp2"):
        assert r[f"{side}_profiler_peak_bytes_adamw"] > 0
        assert r[f"{side}_peak_phase_adamw"] in PHASES[1:]
        sites = r[f"{side}_peak_sites_adamw"]
        assert sites and all(s["bytes"] > 0 and s["count"] > 0 for s in sites)
        assert sum(s["bytes"] for s in sites) <= r[f"{side}_peak_bytes_adamw"]
    assert "profiler_peak_ratio_vs_fsdp2_adamw" in r
    assert r["init_peak_bytes"] <= r["init_bound_bytes"]
    expected = 3 * 4 * r["params"] / 2  # fp32 shards + two AdamW moments, a half per rank
    assert expected <= r["ours_start_bytes_adamw"] <= r["fsdp2_start_bytes_adamw"] * 1.01
    assert r["ours_peak_bytes_adamw"] > r["ours_start_bytes_adamw"]


def test_device_cuda_is_refused_clearly_where_it_cannot_run():
    from ragged_optim.bench.cli import run_benchmark
    from ragged_optim.comm.launch import run_on_ranks

    with pytest.raises(ValueError, match=r"'muon' runs on CPU only \(--device is for: memory, fsdp, peers\)"):
        run_benchmark("muon", device="cuda")
    with pytest.raises(ValueError, match=r"world_size=2 NCCL ranks need as many GPUs; this machine has 0"):
        run_on_ranks(print, 2, device="cuda")
    with pytest.raises(ValueError, match=r"device must be 'cpu' \(gloo\) or 'cuda' \(NCCL\), got 'tpu'"):
        run_on_ranks(print, 1, device="tpu")


def test_muon_host_step_script_runs_as_documented():
    """`python benchmarks/muon_host_step.py` (docs/benchmarks.md) prints one JSON line with both medians and the
    paired ratio (a few steps here: the figure itself is not checked, the timing is the machine's)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "muon_host_step.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "4"], capture_output=True, text=True, check=True)
    obj = json.loads(out.stdout)
    assert obj["steps"] == 4 and obj["d_model"] == 16
    assert obj["ours_ms_median"] > 0 and obj["torch_ms_median"] > 0 and obj["paired_ratio_ours_over_torch"] > 0


def test_adamw8bit_fidelity_script_runs_as_documented():
    """`python benchmarks/adamw8bit_fidelity.py` (docs/benchmarks.md) prints one JSON line per seed: ours is a row
    with its update error against fp32 AdamW (a few steps here), a peer that is missing is a row with its reason."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "adamw8bit_fidelity.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "2"], capture_output=True, text=True, check=True)
    (line,) = out.stdout.strip().splitlines()
    obj = json.loads(line)
    ours = obj["ro.AdamW8bit"]
    assert obj["steps"] == 2 and ours["status"] == "ok"
    assert 0 < ours["update_rel_err_mean"] <= ours["update_rel_err_max"] < 1
    for peer in ("bitsandbytes AdamW8bit", "torchao AdamW8bit"):
        assert obj[peer]["status"] == "ok" or "Error" in obj[peer]["status"]


def test_sqrt_v_storage_tracks_adams_second_moment_better_than_v():
    """`python benchmarks/adamw8bit_v_formats.py` (docs/benchmarks.md): on its synthetic gradient streams, the error
    in ``1/sqrt(v)`` (what the update multiplies by) is smaller with ``sqrt(v)`` stored, as AdamW8bit stores it,
    than with ``v`` stored (bitsandbytes), for Gaussian and heavy-tailed gradients; stochastic rounding is unbiased
    but not more accurate."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "adamw8bit_v_formats.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    rows = {(r["gradients"], r["format"]): r for r in map(json.loads, out.stdout.strip().splitlines())}
    for grads in ("gaussian", "student-t"):
        ours = rows[(grads, "sqrt(v), absmax")]["inv_sqrt_v_rms_rel_err"]
        assert ours < rows[(grads, "v, absmax")]["inv_sqrt_v_rms_rel_err"]
        assert ours < rows[(grads, "sqrt(v), stochastic")]["inv_sqrt_v_rms_rel_err"]
        assert abs(rows[(grads, "sqrt(v), stochastic")]["sqrt_v_rel_err_median"]) < 0.005


def test_peers_by_seed_merge_equals_one_process(monkeypatch, tmp_path):
    """`benchmarks/peers_by_seed.py`: seeds trained in separate runs and merged give what one `peers.run` over
    those seeds gives (the losses, per seed and as keys; the times are the machine's)."""
    import importlib.util
    from pathlib import Path

    from ragged_optim.bench import peers

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "peers_by_seed.py"
    spec = importlib.util.spec_from_file_location("peers_by_seed", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setitem(peers.FAMILIES, "adamw8bit", ["ro.AdamW8bit", "torch.optim.AdamW (fp32)"])
    files = []
    for seed in (1, 0):
        files.append(str(tmp_path / f"seed{seed}.json"))
        assert script.main(["--seed", str(seed), "--families", "adamw8bit", "--steps", "2", "--out", files[-1]]) == 0
    merged = script.merge(files)
    whole = peers.run(steps=2, seeds=(1, 0), families=("adamw8bit",))
    for row in ("ro.AdamW8bit", "torch.optim.AdamW (fp32)"):
        a, b = merged["families"]["adamw8bit"][row], whole["families"]["adamw8bit"][row]
        assert a["val_loss_per_seed"] == b["val_loss_per_seed"] and a["max_step_over_lr"] == b["max_step_over_lr"]
    for key in ("adamw8bit_val_loss_ratio_vs_fp32", "adamw8bit_val_loss_ratio_vs_fp32_per_seed", "seeds", "steps"):
        assert merged[key] == whole[key]
    with pytest.raises(SystemExit, match="the same seed twice"):
        script.merge([files[0], files[0]])


def test_tp_bench_muon_part_keys_and_sanity():
    """`bench tp`'s Muon part at a tiny size (mesh (2, 2), 1 block of width 24): ours bitwise equal to one process,
    fewer collectives and bytes than torch.optim.Muon on the same FSDP2 + TP params (failed before: ro.Muon refused
    these params)."""
    from ragged_optim.bench.tp_muon import muon_part

    r = muon_part(world_size=4, steps=1, scale=16, n_layers=1)
    assert_keys_documented("tp", r)
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in r["muon_placements"]
    assert "(Shard(dim=0), Shard(dim=1))" in r["muon_placements"]
    assert r["muon_max_rel_diff_vs_unsharded"] == 0.0  # the same ops on the same whole matrices, one thread each
    assert r["muon_ours_vs_torch_rel_diff_unsharded"] == 0.0  # the same rule as torch's: the peer is comparable
    assert r["muon_ours_collectives_per_step"] < r["muon_torch_collectives_per_step"]
    assert r["muon_ours_bytes_per_step"] < r["muon_torch_bytes_per_step"]
    assert r["muon_ours_comm"]["calls"]["all_to_all"] == 2  # one gather, one scatter, for every matrix of the mesh
    assert math.isclose(r["muon_speedup_vs_torch"], r["muon_torch_opt_step_s"] / r["muon_ours_opt_step_s"])
    assert len(r["owner_compute_loads"]) == 4 and r["owner_compute_max_over_mean"] >= 1.0
