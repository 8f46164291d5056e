"""ragged-optim: Muon, Shampoo, SOAP and 8-bit AdamW on a RaggedShard FSDP layer.

import ragged_optim as ro
for block in model.layers:
    ro.fully_shard(block)
ro.fully_shard(model)
opt = ro.Muon(ro.muon_param_groups(model), lr=0.02)

The names below are imported on first use (PEP 562), so that ``import ragged_optim`` (and with it the
``ragged-optim`` command line, whose ``--help`` needs no torch) costs nothing until one of them is used.
"""

# ruff: noqa: F401  (the TYPE_CHECKING imports below are for type checkers: the names are in __all__)
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module it lives in
_EXPORTS = {
    "CheckpointError": "ragged_optim.checkpoint",
    "get_full_optimizer_state_dict": "ragged_optim.checkpoint",
    "is_complete": "ragged_optim.checkpoint",
    "latest_checkpoint": "ragged_optim.checkpoint",
    "load_checkpoint": "ragged_optim.checkpoint",
    "save_checkpoint": "ragged_optim.checkpoint",
    "SOAP": "ragged_optim.optim",
    "AdamW8bit": "ragged_optim.optim",
    "Muon": "ragged_optim.optim",
    "Shampoo": "ragged_optim.optim",
    "muon_param_groups": "ragged_optim.optim",
    "Block": "ragged_optim.optim.blocks",
    "BlockOptimizer": "ragged_optim.optim.blocks",
    "all_reduce_over_shards": "ragged_optim.optim.blocks",
    "declare_blocks": "ragged_optim.optim.blocks",
    "full_shape": "ragged_optim.optim.blocks",
    "local": "ragged_optim.optim.blocks",
    "local_range": "ragged_optim.optim.blocks",
    "set_nonfinite_policy": "ragged_optim.optim.nonfinite",
    "Blocks": "ragged_optim.sharding.state_schema",
    "Elem": "ragged_optim.sharding.state_schema",
    "Replicated": "ragged_optim.sharding.state_schema",
    "BlockSpec": "ragged_optim.sharding",
    "CommPolicy": "ragged_optim.sharding",
    "QuantizedAllGather": "ragged_optim.sharding",
    "clip_grad_norm_": "ragged_optim.sharding",
    "full_grad": "ragged_optim.sharding",
    "full_tensor": "ragged_optim.sharding",
    "fully_shard": "ragged_optim.sharding",
    "get_full_state_dict": "ragged_optim.sharding",
    "init_weights": "ragged_optim.sharding",
    "load_full_state_dict": "ragged_optim.sharding",
    "match_layout": "ragged_optim.sharding",
    "register_fsdp_forward_method": "ragged_optim.sharding",
    "shard_info": "ragged_optim.sharding",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ragged_optim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from ragged_optim.checkpoint import (
        CheckpointError,
        get_full_optimizer_state_dict,
        is_complete,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from ragged_optim.optim import SOAP, AdamW8bit, Muon, Shampoo, muon_param_groups
    from ragged_optim.optim.blocks import (
        Block,
        BlockOptimizer,
        all_reduce_over_shards,
        declare_blocks,
        full_shape,
        local,
        local_range,
    )
    from ragged_optim.optim.nonfinite import set_nonfinite_policy
    from ragged_optim.sharding import (
        BlockSpec,
        CommPolicy,
        QuantizedAllGather,
        clip_grad_norm_,
        full_grad,
        full_tensor,
        fully_shard,
        get_full_state_dict,
        init_weights,
        load_full_state_dict,
        match_layout,
        register_fsdp_forward_method,
        shard_info,
    )
    from ragged_optim.sharding.state_schema import Blocks, Elem, Replicated
