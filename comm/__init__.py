"""Collectives over a ProcessGroup: flat all-gather / reduce-scatter, owner gather/scatter, counters."""

from ragged_optim.comm.exit_guard import install as _install_exit_guard

_install_exit_guard()  # any process that uses this library: a clean exit with gloo (see comm/exit_guard.py)
