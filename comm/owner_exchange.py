"""Gather blocks whole to an owner rank and scatter results back: one all_to_all_single each way for any number
of blocks (Muon's matrices, split blocks), with per-rank split sizes. Pieces a rank sends to itself never touch
the wire, and when no block needs another rank's data the collective is skipped on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragged_optim.comm.collectives import all_to_all_flat
from ragged_optim.comm.quantized import pack, packed_nbytes, unpack

#: Elements per scale when pieces travel block-quantized.
WIRE_BLOCK = 128


@dataclass(frozen=True)
class Runs:
    """Where a piece's elements sit in its block when they are not one contiguous range (a TP-sharded DTensor's
    pieces: a run per row): ``groups`` of ``(lo, rows, stride, cols)``, each ``rows`` runs of ``cols`` elements,
    ``stride`` apart, from block-local ``lo``, in the piece's element order."""

    groups: tuple[tuple[int, int, int, int], ...]

    @property
    def n(self) -> int:
        return sum(rows * cols for _, rows, _, cols in self.groups)

    @staticmethod
    def of(runs: list[tuple[int, int]]) -> Runs:
        """From ``[lo, hi)`` runs in order: consecutive runs of one length at one stride become one group."""
        groups: list[list[int]] = []
        for lo, hi in runs:
            n = hi - lo
            if groups:
                g = groups[-1]
                if g[3] == n and (g[1] == 1 or lo - (g[0] + (g[1] - 1) * g[2]) == g[2]):
                    if g[1] == 1:
                        g[2] = lo - g[0]
                    g[1] += 1
                    continue
            groups.append([lo, 1, 0, n])
        return Runs(tuple(tuple(g) for g in groups))

    def _view(self, block: torch.Tensor, g) -> torch.Tensor:
        lo, rows, stride, cols = g
        if rows == 1:
            return block[lo : lo + cols]
        return block.as_strided((rows, cols), (stride, 1), block.storage_offset() + lo)

    def take(self, block: torch.Tensor) -> torch.Tensor:
        """The piece's elements of a 1-D contiguous block, in piece order."""
        if len(self.groups) == 1 and self.groups[0][1] == 1:
            return self._view(block, self.groups[0])
        block = block.contiguous()
        return torch.cat([self._view(block, g).reshape(-1) for g in self.groups])

    def put(self, block: torch.Tensor, values: torch.Tensor) -> None:
        """Write the piece's elements (1-D, piece order) into a 1-D contiguous block."""
        pos = 0
        for g in self.groups:
            n = g[1] * g[3]
            view = self._view(block, g)
            view.copy_(values[pos : pos + n].view(view.shape))
            pos += n


def _runs_of(piece) -> tuple[int, Runs]:
    """A route piece as ``(rank, Runs)``: ``(rank, lo, hi)`` (a contiguous range) or ``(rank, Runs)``."""
    if len(piece) == 3:
        r, lo, hi = piece
        return r, Runs(((lo, 1, 0, hi - lo),))
    return piece


@dataclass(frozen=True)
class BlockRoute:
    """Where one block's elements live and who computes it. ``pieces``: what each source rank sends, ``(rank, lo,
    hi)`` block-local ranges or ``(rank, Runs)``, each element from one rank; ``targets``: the pieces each rank
    receives back (default: ``pieces``; more when replicas hold the same elements and all need the result)."""

    numel: int
    owner: int
    pieces: tuple
    targets: tuple | None = None


class OwnerExchange:
    """A precomputed exchange for a fixed list of routes over ``group`` (this process is ``rank``)."""

    def __init__(self, routes: list[BlockRoute], rank: int, world_size: int, group=None):
        self.routes, self.rank, self.world_size, self.group = routes, rank, world_size, group
        # Per peer, in route order, (route index, Runs): the gather's sends and receives, then the scatter's.
        self.send = [[] for _ in range(world_size)]
        self.recv = [[] for _ in range(world_size)]
        self.back_send = [[] for _ in range(world_size)]
        self.back_recv = [[] for _ in range(world_size)]
        self._mine: dict[int, Runs] = {}  # this rank's own piece of a route it owns (gather)
        self._mine_back: dict[int, Runs] = {}  # and of its result (scatter)
        for ri, route in enumerate(routes):
            for r, runs in map(_runs_of, route.pieces):
                if runs.n <= 0:
                    continue
                if r == rank and route.owner != rank:
                    self.send[route.owner].append((ri, runs))
                elif route.owner == rank and r != rank:
                    self.recv[r].append((ri, runs))
                elif r == rank:
                    self._mine[ri] = runs
            for r, runs in map(_runs_of, route.pieces if route.targets is None else route.targets):
                if runs.n <= 0:
                    continue
                if route.owner == rank and r != rank:
                    self.back_send[r].append((ri, runs))
                elif r == rank and route.owner != rank:
                    self.back_recv[route.owner].append((ri, runs))
                elif r == rank:
                    self._mine_back[ri] = runs
        # Decided from the routes alone, so that every rank skips a collective or joins it alike.
        moves = lambda pieces, owner: any(r != owner and x.n > 0 for r, x in map(_runs_of, pieces))
        self.needs_wire = any(moves(route.pieces, route.owner) for route in routes)
        self.needs_wire_back = any(
            moves(route.pieces if route.targets is None else route.targets, route.owner) for route in routes
        )
        self.send_splits = [sum(x.n for _, x in s) for s in self.send]
        self.recv_splits = [sum(x.n for _, x in s) for s in self.recv]
        self.owned = [ri for ri, route in enumerate(routes) if route.owner == rank]

    def _move(
        self, parts: list[torch.Tensor], send_lists, recv_lists, wire, dtype, device, cast: bool = True
    ) -> list[torch.Tensor]:
        """One all_to_all: ``parts`` go out in ``send_lists`` order; returns the pieces received, in
        ``recv_lists`` order, as ``dtype`` (``cast=False``: in the wire dtype, views of the receive buffer, for a
        caller that copies them into ``dtype`` buffers anyway: no converted copy of the whole buffer).
        ``wire``: a dtype, or ``"int8"`` / ``"fp8_e4m3"`` (block-quantized)."""
        sizes = lambda lists, f: [sum(f(x.n) for _, x in lst) for lst in lists]
        if isinstance(wire, str):
            nbytes = lambda n: packed_nbytes(n, WIRE_BLOCK)
            encoded = [pack(p.contiguous(), WIRE_BLOCK, wire) for p in parts]
            send = torch.cat(encoded) if encoded else torch.empty(0, dtype=torch.uint8, device=device)
            recv_sizes = sizes(recv_lists, nbytes)
            recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
            all_to_all_flat(recv, send, recv_sizes, sizes(send_lists, nbytes), group=self.group)
            pieces, pos = [], 0
            for lst in recv_lists:
                for _, x in lst:
                    n = x.n
                    out = torch.empty(n, dtype=dtype, device=device)
                    pieces.append(unpack(recv[pos : pos + nbytes(n)], n, WIRE_BLOCK, wire, out))
                    pos += nbytes(n)
            return pieces
        send = torch.empty(sum(p.numel() for p in parts), dtype=wire, device=device)
        pos = 0
        for p in parts:  # cast while copying in: one buffer, not a concatenation and its cast copy
            send[pos : pos + p.numel()].copy_(p.reshape(-1))
            pos += p.numel()
        recv_sizes = sizes(recv_lists, lambda n: n)
        recv = torch.empty(sum(recv_sizes), dtype=wire, device=device)
        all_to_all_flat(recv, send, recv_sizes, sizes(send_lists, lambda n: n), group=self.group)
        del send
        return list(torch.split(recv.to(dtype) if cast else recv, [x.n for lst in recv_lists for _, x in lst]))

    def gather(self, local: list[torch.Tensor | None], wire=None, dtype=None, device=None) -> dict:
        """``local[i]``: this rank's piece of route i (1-D, its piece's length; None if it sends none).
        Returns ``{route index: full 1-D block}`` for the routes this rank owns. ``wire``: the dtype on the wire
        (default: the pieces'), or ``"int8"`` / ``"fp8_e4m3"`` for block-quantized pieces. ``dtype``, ``device``: the
        blocks' (default: the pieces'; give them when a rank may hold no piece, so that every rank agrees and no
        buffer is made off the params' device). A rank sends every route one piece at most: its elements of the
        block, in its order."""
        if dtype is None:
            dtype = next((t.dtype for t in local if t is not None), torch.float32)
        if device is None:
            device = next((t.device for t in local if t is not None), torch.device("cpu"))
        full = {ri: torch.empty(self.routes[ri].numel, dtype=dtype, device=device) for ri in self.owned}
        if self.needs_wire:
            parts = [local[ri] for s in self.send for ri, _ in s]
            pieces = iter(self._move(parts, self.send, self.recv, wire or dtype, dtype, device, cast=False))
            for lst in self.recv:  # (each piece cast as it is copied into its block)
                for ri, runs in lst:
                    runs.put(full[ri], next(pieces))
        for ri, runs in self._mine.items():
            runs.put(full[ri], local[ri].to(dtype))
        return full

    def scatter(self, results: dict, wire=None, dtype=None, device=None) -> dict:
        """``results``: ``{route index: full 1-D block}`` for the routes this rank owns. Returns
        ``{route index: this rank's piece}`` for every route this rank receives a piece of (in ``dtype``, default the
        results'; give it, and ``device``, when a rank may own no block, so that every rank agrees)."""
        if dtype is None:
            dtype = next((t.dtype for t in results.values()), torch.float32)
        if device is None:
            device = next((t.device for t in results.values()), torch.device("cpu"))
        out = {}
        if self.needs_wire_back:
            parts = [runs.take(results[ri]) for s in self.back_send for ri, runs in s]
            pieces = iter(self._move(parts, self.back_send, self.back_recv, wire or dtype, dtype, device))
            for lst in self.back_recv:
                for ri, _ in lst:
                    out[ri] = next(pieces)
        for ri, runs in self._mine_back.items():
            out[ri] = runs.take(results[ri])
        return out
