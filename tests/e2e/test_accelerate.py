"""HF accelerate's own FSDP2 code (``Accelerator.prepare`` with ``FullyShardedDataParallelPlugin(fsdp_version=2)``)
with ``ragged_optim.fully_shard`` swapped in for torch's at the one import accelerate uses
(``torch.distributed.fsdp.fully_shard``), torch's FSDP2 in the same test as the control. accelerate offers FSDP
only on accelerators, so a CPU shim sets its distributed type to FSDP (before ``prepare`` and before
``save_state``, where it has reverted); nothing else is patched, for either side."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from ragged_optim.comm.launch import run_on_ranks

pytest.importorskip("accelerate")

STEPS = 3


def _as_fsdp(acc, plugin) -> None:
    from accelerate.utils import DistributedType

    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin


def _train(rank, world, kind: str, efficient_loading: bool, folder: str):
    """STEPS steps of a tiny Llama through accelerate's FSDP2 path; with plain loading the state is also saved
    (``save_state``: DCP) after step 1 and loaded back after the last step, and step 1 is taken again: its loss must
    repeat."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed.fsdp as torch_fsdp
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from fsdp_models import tiny_llama
    from torch.distributed.fsdp import FSDPModule

    import ragged_optim as ro

    if kind == "ours":
        torch_fsdp.fully_shard = ro.fully_shard  # what a user does to use ours inside accelerate
    model = tiny_llama(0, vocab_size=64, intermediate_size=48, max_position_embeddings=32)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        cpu_ram_efficient_loading=efficient_loading,  # True: shard on meta, then load_state_dict(assign=True)
    )
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    _as_fsdp(acc, plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)

    def step(s: int) -> float:
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * s + rank))
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    losses = []
    for s in range(STEPS):
        losses.append(step(s))
        if s == 0 and not efficient_loading:  # (the save and load are the same either way: tested once)
            _as_fsdp(acc, plugin)
            acc.save_state(folder)
    again = None
    if not efficient_loading:
        _as_fsdp(acc, plugin)
        acc.load_state(folder)
        again = step(1)
    params = [p.full_tensor() for p in model.parameters()]
    return {
        "fsdp_module": isinstance(model, FSDPModule),
        "param_type": type(next(model.parameters())).__name__,
        "losses": losses,
        "resumed_loss": again,
        "params": params,
    }


@pytest.mark.parametrize("efficient_loading", [False, True], ids=["plain_loading", "cpu_ram_efficient_loading"])
def test_accelerate_fsdp2_path_with_our_fully_shard_matches_torch_fsdp2(efficient_loading):
    """On main: ``TypeError: fully_shard() got an unexpected keyword argument 'offload_policy'``, and with
    cpu_ram_efficient_loading ``load_state_dict(assign=True) ... cannot be replaced``."""
    out = {}
    for kind in ("torch", "ours"):
        with tempfile.TemporaryDirectory() as folder:
            out[kind] = run_on_ranks(_train, 2, kind, efficient_loading, folder)
    for torch_rank, ours_rank in zip(out["torch"], out["ours"]):
        assert torch_rank["fsdp_module"] and ours_rank["fsdp_module"]
        assert ours_rank["param_type"] == "RaggedDTensor" and torch_rank["param_type"] == "DTensor"
        # two ranks' grads summed (either order gives the same bits), element-wise AdamW: FSDP2's bits exactly
        assert ours_rank["losses"] == torch_rank["losses"]
        if not efficient_loading:
            assert ours_rank["resumed_loss"] == ours_rank["losses"][1] == torch_rank["resumed_loss"]
        assert all(torch.equal(a, b) for a, b in zip(ours_rank["params"], torch_rank["params"]))
