"""The planner's traffic figure against the wire: ``layout_stats(layout)["owner_moved_elements"]`` (owner-computed
blocks' elements that are not on their owner) is what one Muon step sends, gathered to the owners and scattered
back, counted by the collective counter on a tiny transformers Llama sharded with ``ro.fully_shard``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from fsdp_models import local_rows, tiny_llama

import ragged_optim as ro
from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.sharding.planner import layout_stats


def _moved_and_sent(rank, world_size):
    model = tiny_llama()
    for layer in model.model.layers:
        ro.fully_shard(layer)
    ro.fully_shard(model)
    opt = ro.Muon(ro.muon_param_groups(model), lr=0.02, wire_dtype=torch.float32)  # 4 bytes per element sent
    ids = local_rows(torch.randint(0, 96, (6, 8), generator=torch.Generator().manual_seed(1)), rank, world_size)
    model(input_ids=ids, labels=ids).loss.backward()
    with count_collectives() as stats:
        opt.step()
    units = {id(info.unit): info.unit for p in model.parameters() if (info := ro.shard_info(p)) is not None}
    figures = [layout_stats(u.layout) for u in units.values()]  # the layouts Muon planned, with their final owners
    sent = torch.tensor(float(stats.bytes.get("all_to_all", 0)), dtype=torch.float64)
    dist.all_reduce(sent)
    return {
        "moved_elements": sum(f["owner_moved_elements"] for f in figures),
        "moved_blocks": sum(f["owner_moved_blocks"] for f in figures),
        "cut_blocks": sum(f["owner_cut_blocks"] for f in figures),
        "bytes_sent_all_ranks": sent.item(),
        "all_to_all_calls": stats.calls.get("all_to_all", 0),
    }


def test_owner_moved_elements_is_what_a_muon_step_sends():
    """3 ranks: rank boundaries cut some of the Llama's matrices. Every rank sends its pieces of the matrices it does
    not own to their owners and receives the results back: 2 * 4 bytes per moved element, over all ranks. Fails on
    the old layout_stats (it skipped owner-computed specs: no owner_* figures, and 0 split bytes for this plan)."""
    results = run_on_ranks(_moved_and_sent, 3)
    assert all(r == results[0] for r in results)  # the layouts are the same on every rank
    r = results[0]
    assert r["cut_blocks"] > 0 and r["moved_blocks"] >= r["cut_blocks"] and r["moved_elements"] > 0
    assert r["all_to_all_calls"] == 2  # one exchange each way
    assert r["bytes_sent_all_ranks"] == 2 * 4 * r["moved_elements"]
