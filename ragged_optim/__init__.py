"""ragged-optim: Muon, Shampoo, SOAP and 8-bit AdamW on a RaggedShard FSDP layer.

import ragged_optim as ro
for block in model.layers:
    ro.fully_shard(block)
ro.fully_shard(model)
opt = ro.Muon(ro.muon_param_groups(model), lr=0.02)
"""

from ragged_optim.checkpoint import get_full_optimizer_state_dict, load_checkpoint, save_checkpoint
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

__version__ = "0.1.0"

__all__ = [
    "get_full_optimizer_state_dict",
    "load_checkpoint",
    "save_checkpoint",
    "set_nonfinite_policy",
    "AdamW8bit",
    "Block",
    "BlockOptimizer",
    "all_reduce_over_shards",
    "declare_blocks",
    "full_shape",
    "local",
    "local_range",
    "Shampoo",
    "SOAP",
    "BlockSpec",
    "CommPolicy",
    "QuantizedAllGather",
    "Muon",
    "clip_grad_norm_",
    "full_grad",
    "full_tensor",
    "fully_shard",
    "get_full_state_dict",
    "init_weights",
    "load_full_state_dict",
    "match_layout",
    "muon_param_groups",
    "register_fsdp_forward_method",
    "shard_info",
]
