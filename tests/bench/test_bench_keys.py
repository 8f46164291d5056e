"""The JSON keys of the benchmarks are documented (docs/benchmarks.md, "JSON keys of each benchmark"), and each
`bench NAME --help` points there. The smoke tests of test_bench.py check fsdp, muon, memory, comm, adamw8bit and
peers on what they already run; the three cheapest (under a second each at these sizes) run here: hsdp, which no
other test runs, and shampoo and soap. Before, shampoo, soap, adamw8bit, comm and hsdp had no documented keys and
muon's `max_rel_diff_vs_unsharded_bfloat16` no meaning (checked: this file failed)."""

from __future__ import annotations

import pytest
from bench_keys import assert_keys_documented, undocumented


def test_an_undocumented_key_is_caught():
    assert undocumented("muon", {"speedup": 1.0, "max_rel_diff_vs_unsharded_bfloat16": 0.2, "new_figure": 1}) == [
        "new_figure"
    ]
    assert undocumented("memory", {"ours_peak_bytes_adamw_ac": 1, "fsdp2_peak_phase_muon": "backward"}) == []


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("hsdp", dict(world_size=2, steps=1, preset="tiny", batch_size=4)),
        ("shampoo", dict(world_size=2, steps=2, shapes=[(24, 16), (16, 40), (9, 9)], max_preconditioner_dim=8)),
        ("soap", dict(world_size=2, steps=2, shapes=[(24, 16), (16, 12), (9, 9)], max_preconditioner_dim=8)),
    ],
)
def test_keys_of_the_small_benchmarks_are_documented(name, kwargs):
    import importlib

    result = importlib.import_module(f"ragged_optim.bench.{name}").run(**kwargs)
    assert_keys_documented(name, result)
