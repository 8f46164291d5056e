"""A small character-level GPT: the model that `train`, the tests and the benchmarks shard.

``model.layers`` is an ``nn.ModuleList`` of pre-LayerNorm blocks, so the usual FSDP recipe applies::

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)

Initialisation is deterministic from a seed and independent of the device and of the default RNG: a model built
on the meta device, materialised with ``to_empty`` and re-initialised with the same seed equals one built on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from ragged_optim.model_presets import PRESETS, GPTConfig, get_config

__all__ = ["GPT", "PRESETS", "GPTConfig", "build_meta_model", "build_model", "get_config", "num_params"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.ln_bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.ln_bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int | None = 0) -> None:
        """Build the model; with ``seed=None`` the parameters are left as allocated (e.g. on meta)."""
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.ln_bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.activation_checkpointing = False  # True: each block's forward is recomputed in backward
        if seed is not None and not self.tok_emb.weight.is_meta:
            self.init_weights(seed)

    def tie_weights(self) -> None:
        """Share the token embedding with the output head (``tie_embeddings``); ``to_empty`` unties them."""
        if self.config.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def materialize(self, device: str | torch.device = "cpu", seed: int = 0) -> GPT:
        """Allocate a meta-built model on ``device``, re-tie the embeddings and initialise from ``seed``."""
        self.to_empty(device=device)
        self.tie_weights()
        self.init_weights(seed)
        return self

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic GPT-2 style init: N(0, std) for matrices and embeddings, std / sqrt(2 L) for the
        projections that write into the residual stream, zeros for biases, ones for LayerNorm weights.

        Values are drawn on the CPU from a generator seeded by ``seed`` in parameter-name order, then copied to
        each parameter's device, so the result does not depend on the device or the global RNG. Call it before
        sharding (a sharded parameter would receive the draws of its local shape only).
        """
        cfg = self.config
        gen = torch.Generator(device="cpu").manual_seed(seed)
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for name, p in self.named_parameters():  # tied weights are listed once
            if name.endswith("bias"):
                value = torch.zeros(p.shape)
            elif ".ln" in name or name.startswith("ln_"):
                value = torch.ones(p.shape)
            else:
                std = resid_std if name.endswith("proj.weight") else cfg.init_std
                value = torch.empty(p.shape).normal_(0.0, std, generator=gen)
            p.copy_(value.to(dtype=p.dtype))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, vocab]``, or, given ``targets`` ``[B, T]``, the mean cross-entropy loss."""
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def num_params(model: nn.Module) -> int:
    """Parameter count, tied weights counted once (works on meta)."""
    return sum(p.numel() for p in model.parameters())


def build_model(preset: str | GPTConfig = "small", seed: int = 0, device: str | torch.device = "cpu") -> GPT:
    """Build a GPT from a preset name or config. On ``device='meta'`` nothing is allocated or initialised;
    materialise later with ``model.materialize(device, seed)``."""
    cfg = preset if isinstance(preset, GPTConfig) else get_config(preset)
    with torch.device(device):
        model = GPT(cfg, seed=None)
    if not torch.device(device).type == "meta":
        model.init_weights(seed)
    return model


def build_meta_model(preset: str | GPTConfig = "small") -> GPT:
    """A GPT on the meta device: shapes only, for planning and memory estimates."""
    return build_model(preset, device="meta")
