"""Sharding layer: block specs, the planner, flat buffers, fully_shard, state dicts."""

from ragged_optim.sharding.comm_policy import CommPolicy, QuantizedAllGather
from ragged_optim.sharding.fully_shard import RaggedFSDPModule, fully_shard, register_fsdp_forward_method, units_of
from ragged_optim.sharding.grad_norm import clip_grad_norm_, total_grad_norm
from ragged_optim.sharding.layout import BlockSpec, Layout, OwnedBlock
from ragged_optim.sharding.layout_match import match_layout
from ragged_optim.sharding.materialize import init_weights
from ragged_optim.sharding.planner import TensorSpec, plan_unit
from ragged_optim.sharding.sharded_param import ShardInfo, full_grad, full_tensor, is_ragged_sharded, shard_info
from ragged_optim.sharding.state_dict import get_full_state_dict, load_full_state_dict

__all__ = [
    "BlockSpec",
    "CommPolicy",
    "QuantizedAllGather",
    "Layout",
    "OwnedBlock",
    "RaggedFSDPModule",
    "ShardInfo",
    "TensorSpec",
    "clip_grad_norm_",
    "full_grad",
    "full_tensor",
    "fully_shard",
    "get_full_state_dict",
    "init_weights",
    "is_ragged_sharded",
    "load_full_state_dict",
    "match_layout",
    "plan_unit",
    "register_fsdp_forward_method",
    "shard_info",
    "total_grad_norm",
    "units_of",
]
