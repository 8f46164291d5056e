"""Collectives over a ProcessGroup: flat all-gather / reduce-scatter, owner gather/scatter, counters."""
