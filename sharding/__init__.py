"""Sharding layer: block specs, the planner, flat buffers, fully_shard, state dicts."""
