"""Run by tests/checkpoint/test_checkpoint_dcp.py under torchrun (not a test itself): load a checkpoint that
ro.save_checkpoint wrote from a ragged-sharded tiny Llama into (a) a torch FSDP2 Llama with torch's own
dcp.load + set_model_state_dict and (b) a ragged-sharded Llama with ro.load_checkpoint (model + AdamW), at this
world size; rank 0 saves both models' full state dicts to argv[2]."""

import sys

import fsdp_models
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import ragged_optim as ro


def tiny_llama(seed):
    return fsdp_models.tiny_llama(seed, vocab_size=97, intermediate_size=50)


def main(path, out):
    dist.init_process_group("gloo")
    full = StateDictOptions(full_state_dict=True)
    fsdp = tiny_llama(seed=5)
    for layer in fsdp.model.layers:
        torch_fully_shard(layer)
    torch_fully_shard(fsdp)
    state = {"model": get_model_state_dict(fsdp)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fsdp, state["model"])
    fsdp_full = get_model_state_dict(fsdp, options=full)
    ours = tiny_llama(seed=5)
    for layer in ours.model.layers:
        ro.fully_shard(layer)
    ro.fully_shard(ours)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ro.load_checkpoint(path, ours, [opt])
    ours_full = ro.get_full_state_dict(ours)
    if dist.get_rank() == 0:
        torch.save({"fsdp2": fsdp_full, "ours": ours_full}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
