"""Benchmark: SOAP on RaggedShard vs a replicated SOAP, in the same run on W local gloo ranks.

- ours: ``ragged_optim.fully_shard`` + ``SOAP``; each rank computes only the bands it holds (cut bands on their
  owner, one all_to_all each way per step), and keeps only those bands' factors, eigenbases and moments.
- replicated: what a single-device SOAP on FSDP2 does with gathered gradients: every rank all-gathers the full
  gradients and computes every band of every matrix (the same ``SOAP`` on plain full tensors).

Both see the same gradients each step. The replicated run is a one-process SOAP (each rank runs it whole), so it is
also the reference for ``max_rel_diff_vs_unsharded``. The first step (statistics and ``eigh`` only) is not timed;
``precondition_frequency=2`` puts a QR basis refresh in every other timed step (the default, 10, would put none in
a short run). Timings are per rank, averaged over the timed steps; a step takes as long as its slowest rank, so the
max over ranks is reported. Bytes are counted with :func:`ragged_optim.comm.counter.count_collectives`.
"""

from __future__ import annotations

from ragged_optim.bench.shampoo import run_band_bench
from ragged_optim.optim.soap import SOAP

#: 10 matrices of 256..1024 rows and 128..256 columns (several not multiples of 256: partial bands), so that with
#: B = 256 every band has both a left and a right factor.
DEFAULT_SHAPES = (
    (256, 256),
    (512, 256),
    (768, 256),
    (1024, 128),
    (384, 192),
    (640, 160),
    (320, 256),
    (896, 224),
    (512, 128),
    (1024, 256),
)


def run(
    world_size: int = 4,
    steps: int = 5,
    json: bool = True,
    *,
    shapes=DEFAULT_SHAPES,
    max_preconditioner_dim: int = 256,
    seed: int = 0,
    timeout_s: float = 600.0,
    **opt_kw,
) -> dict:
    """Run the benchmark on ``world_size`` gloo ranks for ``steps`` steps (the first is not timed); returns a
    JSON-serialisable dict:

    ``ours_opt_step_s`` / ``replicated_opt_step_s`` (mean seconds per timed step, max over ranks), ``speedup``
    (replicated / ours), ``precond_bytes_max_over_mean`` (bytes of band state per rank: factors, bases, moments),
    ``state_bytes_max_over_mean`` (all optimizer state bytes per rank, as ``train``'s summary counts them),
    ``ours_bytes_per_step`` / ``replicated_bytes_per_step`` (collective bytes per rank per step, max over ranks),
    ``ours_collectives_per_step``, ``max_rel_diff_vs_unsharded`` (ours vs the one-process run, max over params of
    max|diff| / max|ref|). ``json`` is accepted for the CLI's sake; the result is always a plain dict."""
    opt_kw = {"precondition_frequency": 2, **opt_kw}
    out = run_band_bench(SOAP, world_size, steps, shapes, max_preconditioner_dim, seed, timeout_s, opt_kw)
    return {**out, "precondition_frequency": opt_kw["precondition_frequency"]}


if __name__ == "__main__":
    import json as _json
    import sys

    print(_json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 4), indent=1))
