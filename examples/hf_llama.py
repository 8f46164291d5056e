"""A transformers LlamaForCausalLM, sharded with ragged-optim, trained with Muon under torchrun, saved with
``save_pretrained``.

    ./dev torchrun --standalone --nproc-per-node 2 examples/hf_llama.py --steps 10 --out runs/llama-tiny

(``./dev torchrun`` is .venv's torchrun; ``runs/`` is git-ignored.)

The model is built from a config (a tiny one here; nothing is downloaded), with gradient checkpointing on: each
decoder layer's forward runs again inside backward. Every rank builds the same weights (same seed), runs every
forward and backward, and calls ``ro.get_full_state_dict`` (a collective); rank 0 alone writes the files.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import ragged_optim as ro


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as in Llama 3
        max_position_embeddings=64,
        use_cache=False,  # no KV cache in training (and gradient checkpointing refuses one)
    )


def batch(step: int, rows: int, seq: int, vocab: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of a global batch of counting sequences (next token = token + 1), the same at any W."""
    g = torch.Generator().manual_seed(step)
    tokens = (torch.randint(0, vocab, (rows, 1), generator=g) + torch.arange(seq)) % vocab
    per = rows // world_size
    return tokens[rank * per : (rank + 1) * per]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    ap.add_argument("--batch-size", type=int, default=6, help="global rows per step, a multiple of W (default 6)")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per row (default 32)")
    ap.add_argument("--out", default=None, help="save_pretrained folder (default: none)")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))  # torchrun's RANK, WORLD_SIZE, ...
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size < 1 or args.batch_size % world_size:  # (it trained on fewer rows, silently)
        raise SystemExit(f"--batch-size {args.batch_size} must be a positive multiple of the world size {world_size}")
    config = tiny_config()
    torch.manual_seed(0)  # the same weights on every rank
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints only in training mode

    for layer in model.model.layers:
        ro.fully_shard(layer)
    ro.fully_shard(model)  # the root unit: embeddings, final norm, lm_head
    # Muon on the attention and MLP matrices; AdamW on embed_tokens, lm_head and the norms
    opt = ro.Muon(ro.muon_param_groups(model), lr=0.02, adamw_lr=3e-3)

    for step in range(args.steps):
        ids = batch(step, args.batch_size, args.seq_len, config.vocab_size, rank, world_size)
        loss = model(input_ids=ids, labels=ids).loss  # transformers shifts the labels
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f} (rank 0's rows)")

    # The model as plain tensors under transformers' names: every rank takes part in the gathers.
    state = ro.get_full_state_dict(model)
    eval_ids = batch(10**6, 2, args.seq_len, config.vocab_size, 0, 1)
    with torch.no_grad():
        sharded_eval = model(input_ids=eval_ids, labels=eval_ids).loss.item()  # every rank: a collective
    if rank == 0 and args.out:
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(state)
        plain.save_pretrained(args.out)
        reloaded = LlamaForCausalLM.from_pretrained(args.out)
        with torch.no_grad():
            reloaded_eval = reloaded(input_ids=eval_ids, labels=eval_ids).loss.item()
        print(f"saved {args.out}: eval loss {reloaded_eval!r} reloaded, {sharded_eval!r} sharded")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
