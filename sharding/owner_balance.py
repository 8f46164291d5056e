"""Who computes each block: one balancer for every kind of param (ragged units, FSDP2 ``DTensor`` params) and every
optimizer, and the one cost formula for matrix blocks.

:func:`balance_owners` takes a list of block costs (what the optimizer's ``block_cost`` says each block costs:
compute, or the state it keeps) and optional holder hints (the rank that already holds the block, so that keeping
it there moves no data), and returns an owner rank per block over a given list of ranks. It is a longest-processing-
time greedy: blocks largest first, each to its first holder whose load stays under the cap
``(1 + slack) * max(mean load, largest block)``, else to the least-loaded rank (lowest position on ties). The ranks
are any list (a process group's ranks, or every rank of an N-D mesh), so the same call balances one group or a whole
job.

:func:`newton_schulz_cost` (``m * n * min(m, n)``, the flops of Newton-Schulz or a factor product up to a constant)
and :func:`default_block_cost` (that formula on a block's matrix view; a 1-D run of n elements costs n) are the
cost functions the planner, ``BlockOptimizer.block_cost`` and Muon share.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from ragged_optim.sharding.layout import BlockSpec

__all__ = ["OWNER_SLACK", "balance_owners", "block_matrix_dims", "default_block_cost", "newton_schulz_cost"]

#: How far above the balanced load a holder may go before its block moves to another rank.
OWNER_SLACK = 0.10


def newton_schulz_cost(rows: int, cols: int) -> float:
    """``rows * cols * min(rows, cols)``: the work of one Newton-Schulz iteration (or of ``G G^T``) on a matrix."""
    return float(rows) * cols * min(rows, cols)


def block_matrix_dims(shape: Sequence[int], spec: BlockSpec, numel: int) -> tuple[int, int]:
    """The ``(rows, cols)`` a block of ``numel`` elements of a param of full ``shape`` is computed as: the spec's
    row length when it divides the block, else the param's trailing matrix, its ``[d0, rest]`` view, or a band of
    its rows; ``(1, numel)`` for a run of elements."""
    shape = tuple(shape)
    if spec.row_len and numel % spec.row_len == 0:
        return numel // spec.row_len, spec.row_len
    if len(shape) >= 2 and numel == shape[-2] * shape[-1]:
        return shape[-2], shape[-1]
    if len(shape) >= 2 and numel == math.prod(shape) and shape[0] > 0:
        return shape[0], numel // shape[0]
    if len(shape) >= 2 and shape[-1] > 0 and numel % shape[-1] == 0:
        return numel // shape[-1], shape[-1]
    return 1, numel


def default_block_cost(shape: Sequence[int], spec: BlockSpec, numel: int) -> float:
    """The cost of a block when its optimizer says nothing else: :func:`newton_schulz_cost` of its matrix view
    (:func:`block_matrix_dims`), which is ``numel`` for a 1-D run."""
    return newton_schulz_cost(*block_matrix_dims(shape, spec, numel))


def _preferences(hint, pos: dict[int, int], j: int) -> list[int]:
    if hint is None:
        return []
    hints = [hint] if isinstance(hint, int | np.integer) else list(hint)
    out = []
    for h in hints:
        h = int(h)
        if h < 0:
            continue
        if h not in pos:
            raise ValueError(
                f"balance_owners: holders[{j}] names rank {h}, which is not in ranks {sorted(pos)[:8]}: give holder "
                "hints as ranks of the list being balanced over (or -1 / None for no preference)"
            )
        out.append(pos[h])
    return out


def balance_owners(
    costs: Sequence[float],
    ranks: Sequence[int],
    holders: Sequence[int | Sequence[int] | None] | None = None,
    *,
    load: np.ndarray | None = None,
    slack: float = OWNER_SLACK,
) -> list[int]:
    """An owner rank (a value of ``ranks``) for each block of cost ``costs[j]``, balancing the sum of costs per rank.

    ``holders[j]`` (optional): the rank holding the block (or its largest piece), a sequence of such ranks in order
    of preference, or None / -1 for no preference. A block stays on a holder while that rank's load stays under
    ``(1 + slack) * max(mean load, largest block)`` (then no data moves for it); otherwise it goes to the least-
    loaded rank. ``load`` (optional, float array aligned with ``ranks``): load already placed on each rank (earlier
    units); it is updated in place. Deterministic: the same inputs give the same owners on every rank."""
    ranks = [int(r) for r in ranks]
    if not ranks:
        raise ValueError("balance_owners: ranks is empty; give the ranks the blocks may be computed on")
    pos = {r: k for k, r in enumerate(ranks)}
    if len(pos) != len(ranks):
        raise ValueError(f"balance_owners: ranks {ranks[:8]} has duplicates; give each rank once")
    costs = [float(c) for c in costs]
    for j, c in enumerate(costs):
        if not (c >= 0 and math.isfinite(c)):
            raise ValueError(f"balance_owners: costs[{j}] is {c}; block costs must be finite numbers >= 0")
    if holders is not None and len(holders) != len(costs):
        raise ValueError(f"balance_owners: {len(holders)} holder hints for {len(costs)} blocks; give one per block")
    if not (slack >= 0 and math.isfinite(slack)):
        raise ValueError(f"balance_owners: slack must be a finite number >= 0, got {slack!r}")
    W = len(ranks)
    if load is None:
        load = np.zeros(W, dtype=np.float64)
    elif np.shape(load) != (W,):
        raise ValueError(f"balance_owners: load must have shape ({W},) (one value per rank), got {np.shape(load)}")
    if not costs:
        return []
    cap = max((float(load.sum()) + sum(costs)) / W, max(costs)) * (1 + slack)
    # Only the len(costs) least-loaded ranks can be the least loaded when a block is placed (each placement touches
    # one rank): the heap starts from them, not from all W (an N-D mesh may have many ranks and few blocks).
    k = min(W, len(costs))
    idx = np.argpartition(load, k - 1)[:k] if k < W else np.arange(W)
    heap = [(float(load[r]), int(r)) for r in idx]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        c = costs[j]
        prefs = _preferences(holders[j], pos, j) if holders is not None else []
        owner = next((h for h in prefs if load[h] + c <= cap), None)
        if owner is None:
            while True:
                lv, r = heapq.heappop(heap)
                if lv == load[r]:
                    break  # (an entry left from before this rank's load last changed is skipped)
            owner = r
        load[owner] += c
        heapq.heappush(heap, (float(load[owner]), owner))
        owners[j] = ranks[owner]
    return owners
