"""A tiny transformers LlamaForCausalLM trained a few steps with ro.SOAP, ragged-sharded (ro.fully_shard) and torch
FSDP2 (DTensor params), every rank on the same batches (not a test itself). tests/optim/soap/test_soap_sharded.py calls
``sharded_runs`` on forked ranks; ``torchrun --nproc-per-node 2 tests/support/soap_llama_job.py OUT`` runs the same
under torchrun, and rank 0 saves both models' full state dicts to OUT."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import ragged_optim as ro

STEPS = 4
SOAP_KW = dict(lr=1e-2, max_preconditioner_dim=32, precondition_frequency=2)  # bands with and without R


def tiny_llama():
    from dcp_torchrun_job import tiny_llama as build

    return build(seed=3)


def batch(step):
    x = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(100 + step))
    return x


def train(model):
    opt = ro.SOAP(model.parameters(), **SOAP_KW)
    for step in range(STEPS):
        x = batch(step)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def sharded_runs() -> dict:
    """On every rank of an initialised gloo group: the ragged-sharded and the FSDP2 run's full state dicts."""
    ours = tiny_llama()
    for layer in ours.model.layers:
        ro.fully_shard(layer)
    ro.fully_shard(ours)
    train(ours)
    ours_full = ro.get_full_state_dict(ours)
    fsdp = tiny_llama()
    for layer in fsdp.model.layers:
        torch_fully_shard(layer)
    torch_fully_shard(fsdp)
    train(fsdp)
    fsdp_full = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=True))
    return {"ours": ours_full, "fsdp2": fsdp_full}


def main(out):
    dist.init_process_group("gloo")
    runs = sharded_runs()
    if dist.get_rank() == 0:
        torch.save(runs, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
