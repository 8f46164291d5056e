"""Your own model, sharded with ragged-optim and trained under torchrun.

    ./dev torchrun --standalone --nproc-per-node 3 examples/torchrun_own_model.py --optimizer muon \
        --ckpt runs/own-model-ckpt
    ./dev torchrun --standalone --nproc-per-node 2 examples/torchrun_own_model.py --optimizer muon \
        --ckpt runs/own-model-ckpt --resume --steps 40     # the same run, continued at another world size

(``./dev torchrun`` is .venv's torchrun, run from the repository root; ``runs/`` is git-ignored.)

torchrun starts one process per rank and sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the script calls
``dist.init_process_group`` itself (gloo on CPUs, NCCL on GPUs). What every rank must do, or the job hangs or aborts
(sharded params are gathered and gradients reduced by collectives that all ranks join):

- build the same model with the same seed (or load the same weights) before ``ro.fully_shard``;
- run every forward and backward, evaluation included: an eval on rank 0 alone waits forever for the others;
- call every collective helper: ``ro.save_checkpoint``, ``ro.load_checkpoint``, ``ro.full_tensor``,
  ``ro.full_grad``, ``ro.get_full_state_dict``, ``ro.clip_grad_norm_``;
- step the optimizer (Muon, Shampoo and SOAP gather blocks that a rank boundary cuts to one owner rank).
Only printing and writing files are for rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ragged_optim as ro

VOCAB, DIM, SEQ = 96, 64, 16


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Any nn.Module works: this one returns logits, not a loss object."""

    def __init__(self, n_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(n_layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "muon":
        # hidden matrices get Muon; embeddings, the head and 1-D params AdamW (adamw_lr, adamw_betas, ...)
        return ro.Muon(ro.muon_param_groups(model), lr=0.02, momentum=0.95, adamw_lr=3e-3)
    if name == "shampoo":
        # preconditioners on blocks of at most max_preconditioner_dim rows/cols; Adam grafting sets the step size
        return ro.Shampoo(model.parameters(), lr=3e-3, betas=(0.9, 0.999), epsilon=1e-8, max_preconditioner_dim=64)
    if name == "adamw8bit":
        # 8-bit moments in blocks of block_size elements; tensors under min_8bit_size keep fp32 moments
        return ro.AdamW8bit(model.parameters(), lr=3e-3, weight_decay=0.01, block_size=256, min_8bit_size=4096)
    if name == "soap":
        # Adam in the eigenbasis of Shampoo's factors, refreshed every precondition_frequency steps, per band of
        # at most max_preconditioner_dim rows
        return ro.SOAP(model.parameters(), lr=1e-2, betas=(0.95, 0.95), precondition_frequency=10)
    raise ValueError(f"--optimizer: unknown {name!r}; choose muon, shampoo, soap or adamw8bit")


def batch(step: int, rows: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of a learnable sequence (next token = token + 1 mod VOCAB, from random starts); this rank's
    rows of it. The same global batch at any world size."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (rows, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    per = rows // world_size
    mine = tokens[rank * per : (rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, rank: int, world_size: int) -> float:
    """Every rank runs this forward (it is a collective); the global eval batch, averaged over ranks."""
    x, y = batch(10**6, 12, rank, world_size)
    loss = loss_fn(model, x, y)
    dist.all_reduce(loss)
    return loss.item() / world_size


def weights_checksum(model: nn.Module) -> float:
    """A fingerprint of the full weights (ro.get_full_state_dict is a collective: every rank calls it). Exact:
    a reload at another world size gives the same value."""
    return sum(t.double().sum().item() for _, t in sorted(ro.get_full_state_dict(model).items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", choices=("muon", "shampoo", "soap", "adamw8bit"), default="muon")
    ap.add_argument("--steps", type=int, default=20, help="train until this step (default 20)")
    ap.add_argument("--batch-size", type=int, default=12, help="global rows per step, a multiple of the world size")
    ap.add_argument("--ckpt", default=None, help="checkpoint folder, written at the end (default: none)")
    ap.add_argument("--resume", action="store_true", help="load --ckpt first (at any world size)")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))  # reads torchrun's environment
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if args.batch_size % world_size:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the world size {world_size}")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM().to(device)
    for block in model.layers:
        ro.fully_shard(block)  # one FSDP unit per block: gathered just before its forward, freed after
    ro.fully_shard(model)  # the root: embedding, final norm, head
    opt = make_optimizer(args.optimizer, model)

    step = 0
    if args.resume:
        extra = ro.load_checkpoint(args.ckpt, model, [opt])  # every rank; resharded to this world size
        step = extra["step"]
        checksum = weights_checksum(model)
        if rank == 0:
            print(f"resumed at step {step} on {world_size} ranks: weights checksum {checksum!r}")
    else:
        val = evaluate(model, rank, world_size)  # on every rank
        if rank == 0:
            print(f"step 0: eval loss {val:.4f}")

    while step < args.steps:
        x, y = batch(step, args.batch_size, rank, world_size)
        loss = loss_fn(model, x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 5 == 0 or step == args.steps:
            val = evaluate(model, rank, world_size)  # on every rank
            if rank == 0:
                print(f"step {step}: train loss {loss.item():.4f} (rank 0's rows), eval loss {val:.4f}")

    checksum = weights_checksum(model)
    if args.ckpt:
        ro.save_checkpoint(args.ckpt, model, [opt], extra={"step": step})  # every rank
    if rank == 0:
        saved = f", saved to {args.ckpt}" if args.ckpt else ""
        print(f"step {step} on {world_size} ranks: weights checksum {checksum!r}{saved}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
