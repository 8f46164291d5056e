"""Gather blocks whole to an owner rank and scatter results back: one all_to_all_single each way for any number
of blocks (Muon's matrices, split blocks), with per-rank split sizes. Pieces a rank sends to itself never touch
the wire, and when no block needs another rank's data the collective is skipped on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragged_optim.comm.collectives import all_to_all_flat


@dataclass(frozen=True)
class BlockRoute:
    """Where one block's elements live and who computes it. ``pieces``: ``(rank, lo, hi)`` block-local ranges
    in rank order that tile ``[0, numel)``."""

    numel: int
    owner: int
    pieces: tuple[tuple[int, int, int], ...]


class OwnerExchange:
    """A precomputed exchange for a fixed list of routes over ``group`` (this process is ``rank``)."""

    def __init__(self, routes: list[BlockRoute], rank: int, world_size: int, group=None):
        self.routes, self.rank, self.world_size, self.group = routes, rank, world_size, group
        self.needs_wire = any(r != route.owner for route in routes for r, _, _ in route.pieces)
        # Per destination rank, in route order: (route index, lo, hi) this rank sends there.
        self.send = [[] for _ in range(world_size)]
        # Per source rank, in route order: (route index, lo, hi) this rank receives from there.
        self.recv = [[] for _ in range(world_size)]
        for ri, route in enumerate(routes):
            for r, lo, hi in route.pieces:
                if hi <= lo:
                    continue
                if r == rank and route.owner != rank:
                    self.send[route.owner].append((ri, lo, hi))
                if route.owner == rank and r != rank:
                    self.recv[r].append((ri, lo, hi))
        self.send_splits = [sum(hi - lo for _, lo, hi in s) for s in self.send]
        self.recv_splits = [sum(hi - lo for _, lo, hi in s) for s in self.recv]
        self.owned = [ri for ri, route in enumerate(routes) if route.owner == rank]

    def _local_piece(self, route: BlockRoute) -> tuple[int, int] | None:
        for r, lo, hi in route.pieces:
            if r == self.rank and hi > lo:
                return lo, hi
        return None

    def gather(self, local: list[torch.Tensor | None], wire_dtype: torch.dtype | None = None) -> dict:
        """``local[i]``: this rank's piece of route i (1-D, its pieces' length; None if it holds none).
        Returns ``{route index: full 1-D block}`` for the routes this rank owns."""
        dtype = next((t.dtype for t in local if t is not None), torch.float32)
        device = next((t.device for t in local if t is not None), torch.device("cpu"))
        wire = wire_dtype or dtype
        recv = None
        if self.needs_wire:
            parts = [local[ri] for s in self.send for ri, _, _ in s]  # a rank holds one piece of a block
            send = torch.cat(parts).to(wire) if parts else torch.empty(0, dtype=wire, device=device)
            recv = torch.empty(sum(self.recv_splits), dtype=wire, device=device)
            all_to_all_flat(recv, send, self.recv_splits, self.send_splits, group=self.group)
        full = {ri: torch.empty(self.routes[ri].numel, dtype=dtype, device=device) for ri in self.owned}
        pos = 0
        for src in range(self.world_size):
            for ri, lo, hi in self.recv[src]:
                full[ri][lo:hi] = recv[pos : pos + hi - lo]
                pos += hi - lo
        for ri in self.owned:
            mine = self._local_piece(self.routes[ri])
            if mine is not None:
                lo, hi = mine
                full[ri][lo:hi] = local[ri].to(dtype)
        return full

    def scatter(self, results: dict, wire_dtype: torch.dtype | None = None) -> dict:
        """``results``: ``{route index: full 1-D block}`` for the routes this rank owns. Returns
        ``{route index: this rank's piece}`` for every route this rank holds a piece of."""
        dtype = next((t.dtype for t in results.values()), None)
        device = next((t.device for t in results.values()), torch.device("cpu"))
        out = {}
        if self.needs_wire:
            wire = wire_dtype or dtype or torch.float32
            parts = [results[ri][lo:hi] for s in self.recv for ri, lo, hi in s]
            send = torch.cat(parts).to(wire) if parts else torch.empty(0, dtype=wire, device=device)
            back = torch.empty(sum(self.send_splits), dtype=wire, device=device)
            all_to_all_flat(back, send, self.send_splits, self.recv_splits, group=self.group)
            pos = 0
            for dst in range(self.world_size):
                for ri, lo, hi in self.send[dst]:
                    out[ri] = back[pos : pos + hi - lo]
                    pos += hi - lo
        for ri in self.owned:
            mine = self._local_piece(self.routes[ri])
            if mine is not None:
                out[ri] = results[ri][mine[0] : mine[1]]
        return out
