"""Parameter shapes of public models, grouped into FSDP units, for planning without building the model.

Shapes are written from the published configs (hidden size, intermediate sizes, heads, kv heads, head dim, vocab,
layers, experts). Weights follow the ``nn.Linear`` convention ``[out, in]``; fused experts are 3-D ``[E, out, in]``.
A model is a list of units as FSDP wraps them: one per transformer block, then a root unit with the embedding, the
final norm and the output head. Parameter order inside a unit follows the Hugging Face module definition order.

``units_from_module(module)`` does the same for any ``nn.Module`` (build it on the meta device): the blocks are the
children of the ``nn.ModuleList`` holding the most parameters (the transformer blocks in every common model); each
child is one unit, and every parameter outside that list goes to the root unit (last). A module without any
``nn.ModuleList`` is one root unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

Shape = tuple[int, ...]

__all__ = ["Unit", "MODELS", "model_units", "model_names", "units_from_module"]


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: a name and its parameters (name, shape) in module order."""

    name: str
    params: tuple[tuple[str, Shape], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.params)


def _root(vocab: int, hidden: int, tied: bool = False) -> Unit:
    params = [("embed_tokens.weight", (vocab, hidden)), ("norm.weight", (hidden,))]
    if not tied:
        params.append(("lm_head.weight", (vocab, hidden)))
    return Unit("root", tuple(params))


def _layer(i: int, block) -> Unit:
    """Transformer block ``i`` as one unit: its params ``(name, shape)`` prefixed with ``layers.{i}.``."""
    return Unit(f"layers.{i}", tuple((f"layers.{i}.{n}", s) for n, s in block))


def _gqa_attention(hidden: int, q: int, kv: int):
    """Grouped-query attention projections (no biases): ``q`` query features, ``kv`` key/value features."""
    return (
        ("self_attn.q_proj.weight", (q, hidden)),
        ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.weight", (kv, hidden)),
        ("self_attn.o_proj.weight", (hidden, q)),
    )


def _block_norms(hidden: int):
    return (("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,)))


def _llama(hidden: int, inter: int, heads: int, kv_heads: int, layers: int, vocab: int, head_dim: int = 128):
    mlp = (
        ("mlp.gate_proj.weight", (inter, hidden)),
        ("mlp.up_proj.weight", (inter, hidden)),
        ("mlp.down_proj.weight", (hidden, inter)),
    )
    block = _gqa_attention(hidden, heads * head_dim, kv_heads * head_dim) + mlp + _block_norms(hidden)
    return [*(_layer(i, block) for i in range(layers)), _root(vocab, hidden)]


def _gpt_oss(layers: int, experts: int):
    hidden, inter, heads, kv_heads, head_dim, vocab = 2880, 2880, 64, 8, 64, 201088
    q, kv = heads * head_dim, kv_heads * head_dim
    block = (
        ("self_attn.q_proj.weight", (q, hidden)),
        ("self_attn.q_proj.bias", (q,)),
        ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.k_proj.bias", (kv,)),
        ("self_attn.v_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.bias", (kv,)),
        ("self_attn.o_proj.weight", (hidden, q)),
        ("self_attn.o_proj.bias", (hidden,)),
        ("self_attn.sinks", (heads,)),
        ("mlp.router.weight", (experts, hidden)),
        ("mlp.router.bias", (experts,)),
        ("mlp.experts.gate_up_proj", (experts, 2 * inter, hidden)),
        ("mlp.experts.gate_up_proj_bias", (experts, 2 * inter)),
        ("mlp.experts.down_proj", (experts, hidden, inter)),
        ("mlp.experts.down_proj_bias", (experts, hidden)),
    ) + _block_norms(hidden)
    return [*(_layer(i, block) for i in range(layers)), _root(vocab, hidden)]


def _deepseek_v3():
    hidden, vocab, layers, dense_layers = 7168, 129280, 61, 3
    heads, q_rank, kv_rank, nope, rope, v_dim = 128, 1536, 512, 128, 64, 128
    dense_inter, moe_inter, experts = 18432, 2048, 256
    attn = (
        ("self_attn.q_a_proj.weight", (q_rank, hidden)),
        ("self_attn.q_a_layernorm.weight", (q_rank,)),
        ("self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank)),
        ("self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, hidden)),
        ("self_attn.kv_a_layernorm.weight", (kv_rank,)),
        ("self_attn.kv_b_proj.weight", (heads * (nope + v_dim), kv_rank)),
        ("self_attn.o_proj.weight", (hidden, heads * v_dim)),
    )
    dense = (
        ("mlp.gate_proj.weight", (dense_inter, hidden)),
        ("mlp.up_proj.weight", (dense_inter, hidden)),
        ("mlp.down_proj.weight", (hidden, dense_inter)),
    )
    moe = (
        ("mlp.gate.weight", (experts, hidden)),
        ("mlp.gate.e_score_correction_bias", (experts,)),
        ("mlp.experts.gate_proj", (experts, moe_inter, hidden)),
        ("mlp.experts.up_proj", (experts, moe_inter, hidden)),
        ("mlp.experts.down_proj", (experts, hidden, moe_inter)),
        ("mlp.shared_experts.gate_proj.weight", (moe_inter, hidden)),
        ("mlp.shared_experts.up_proj.weight", (moe_inter, hidden)),
        ("mlp.shared_experts.down_proj.weight", (hidden, moe_inter)),
    )
    units = [_layer(i, attn + (dense if i < dense_layers else moe) + _block_norms(hidden)) for i in range(layers)]
    return [*units, _root(vocab, hidden)]


def _qwen3_moe(hidden: int, layers: int, experts: int, moe_inter: int, heads: int, kv_heads: int, vocab: int):
    head_dim = 128
    rest = (
        ("self_attn.q_norm.weight", (head_dim,)),
        ("self_attn.k_norm.weight", (head_dim,)),
        ("mlp.gate.weight", (experts, hidden)),
        ("mlp.experts.gate_proj", (experts, moe_inter, hidden)),
        ("mlp.experts.up_proj", (experts, moe_inter, hidden)),
        ("mlp.experts.down_proj", (experts, hidden, moe_inter)),
    )
    block = _gqa_attention(hidden, heads * head_dim, kv_heads * head_dim) + rest + _block_norms(hidden)
    return [*(_layer(i, block) for i in range(layers)), _root(vocab, hidden)]


MODELS: dict[str, Callable[[], list[Unit]]] = {
    "llama3-8b": lambda: _llama(4096, 14336, 32, 8, 32, 128256),
    "llama3-70b": lambda: _llama(8192, 28672, 64, 8, 80, 128256),
    "llama3-405b": lambda: _llama(16384, 53248, 128, 8, 126, 128256),
    "gpt-oss-20b": lambda: _gpt_oss(24, 32),
    "gpt-oss-120b": lambda: _gpt_oss(36, 128),
    "deepseek-v3": _deepseek_v3,
    "qwen3-30b-a3b": lambda: _qwen3_moe(2048, 48, 128, 768, 32, 4, 151936),
}


def model_names() -> list[str]:
    return sorted(MODELS)


def model_units(name: str) -> list[Unit]:
    """The units of a catalog model; ValueError listing the known names otherwise."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(model_names())}") from None
    return factory()


def units_from_module(module) -> list[Unit]:
    """Units of any ``nn.Module`` by the rule in the module doc (largest ``nn.ModuleList``'s children, then root)."""
    from torch import nn

    best_name, best_list, best_numel = None, None, 0
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 0:
            numel = sum(p.numel() for p in sub.parameters())
            if numel > best_numel:
                best_name, best_list, best_numel = name, sub, numel
    units: list[Unit] = []
    claimed: set[int] = set()
    if best_list is not None:
        for j, child in enumerate(best_list):
            prefix = f"{best_name}.{j}" if best_name else str(j)
            params = []
            for n, p in child.named_parameters():
                if id(p) in claimed:
                    continue  # a parameter shared with an earlier block belongs to that block's unit
                claimed.add(id(p))
                params.append((f"{prefix}.{n}", tuple(p.shape)))
            if params:
                units.append(Unit(prefix, tuple(params)))
    root = tuple((n, tuple(p.shape)) for n, p in module.named_parameters() if id(p) not in claimed)
    if root:
        units.append(Unit("root", root))
    return units
