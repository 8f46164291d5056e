"""The shared vocabulary of the sharding layer: block specs and the layout a planner produces.

A unit (one ``fully_shard`` call) is one flat buffer of ``world_size * shard_size`` elements; rank k owns
``[k * S, (k + 1) * S)``. Tensor i occupies ``[offsets[i], offsets[i] + numels[i])``; padding sits only between
tensors and after the last one.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockSpec:
    """Which runs of a tensor's flattened elements an optimizer needs whole.

    Blocks are runs of ``block`` elements that restart every ``period`` elements (a matrix of a stack, or the
    whole tensor), so the last block of each period may be shorter. ``owner_computed`` blocks (Muon's whole
    matrices) are always computed on one owner rank, gathered there if the layout cuts them; other blocks are
    computed where they live, and the planner keeps them whole or marks them *split* (then an owner computes them).

    ``tile_cols > 0`` (:meth:`tiles`): each block is a band of whole rows, and the optimizer computes it as 2-D
    tiles of ``tile_cols`` columns (the last one narrower when ``tile_cols`` does not divide the row): the layout
    keeps bands whole, ``map_blocks`` hands each tile on its own, and block indices count tiles.
    """

    block: int
    period: int
    owner_computed: bool = False
    #: Elements per row of a block, so an optimizer can view it as ``[rows, row_len]`` (0: a 1-D run). A view
    #: hint only: it changes no layout, so specs that differ only in it compare equal.
    row_len: int = field(default=0, compare=False)
    #: Columns per 2-D tile (0: blocks are not tiled). Unlike ``row_len`` it is part of the spec's identity: block
    #: indices (and so per-block state) count tiles.
    tile_cols: int = 0

    def __post_init__(self):
        for name in ("block", "period", "row_len", "tile_cols"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool):  # (a float failed deep in the planner)
                raise TypeError(f"BlockSpec {name} must be an int, got {v!r} of type {type(v).__name__}")
            object.__setattr__(self, name, int(v))  # (a numpy integer: a plain int, as hashing and repr expect)
        if not isinstance(self.owner_computed, bool):  # ("no" was taken for True)
            raise TypeError(f"BlockSpec owner_computed must be True or False, got {self.owner_computed!r}")
        if self.block < 1 or self.period < 1:
            raise ValueError(f"BlockSpec sizes must be >= 1, got block={self.block}, period={self.period}")
        if self.row_len < 0:
            raise ValueError(f"BlockSpec row_len must be >= 0 (0: 1-D blocks), got {self.row_len}")
        if self.tile_cols < 0:
            raise ValueError(f"BlockSpec tile_cols must be >= 0 (0: no tiles), got {self.tile_cols}")
        if self.tile_cols and not (self.row_len and self.block % self.row_len == 0 and self.period % self.row_len == 0):
            raise ValueError(
                f"BlockSpec tile_cols={self.tile_cols} needs blocks of whole rows (row_len dividing block and period),"
                f" got block={self.block}, period={self.period}, row_len={self.row_len}: build it with "
                "BlockSpec.tiles(tile_rows, tile_cols, shape)"
            )

    @staticmethod
    def elements(g: int, numel: int) -> BlockSpec:
        """Runs of ``g`` elements of the flattened tensor (8-bit Adam quantization blocks)."""
        return BlockSpec(block=max(1, min(g, numel)), period=max(1, numel))

    @staticmethod
    def rows(g: int, shape) -> BlockSpec:
        """Bands of ``g`` rows of each ``[R, C]`` matrix of a ``[..., R, C]`` tensor; 1-D tensors take runs of g."""
        shape = tuple(shape)
        numel = math.prod(shape)
        if len(shape) < 2:
            return BlockSpec.elements(g, numel)
        r, c = shape[-2], shape[-1]
        return BlockSpec(block=max(1, min(g, r) * c), period=max(1, r * c), row_len=c)

    @staticmethod
    def tiles(tile_rows: int, tile_cols: int, shape) -> BlockSpec:
        """2-D tiles of ``tile_rows x tile_cols`` of each ``[R, C]`` matrix of a ``[..., R, C]`` tensor (a stack of
        matrices, fused experts: tiles never cross a matrix). A tile size that does not divide its dim leaves a
        short last tile (fewer rows at the bottom of each matrix, fewer columns at the right). The layout keeps
        each band of ``tile_rows`` rows whole (rank boundaries fall on tile-row multiples); ``map_blocks`` hands
        every tile as a ``[rows, cols]`` view, indexed row of tiles by row of tiles
        (``index = band * tiles_per_row + column``)."""
        for name, v in (("tile_rows", tile_rows), ("tile_cols", tile_cols)):
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                raise ValueError(f"BlockSpec.tiles: {name} must be an int >= 1, got {v!r}")
        shape = tuple(shape)
        if len(shape) < 2:
            raise ValueError(
                f"BlockSpec.tiles: a param of shape {shape} has no rows and columns to tile; give 2-D tiles to "
                "matrices (or stacks of them) and BlockSpec.elements(n, numel) to 1-D params"
            )
        c = shape[-1]
        band = BlockSpec.rows(tile_rows, shape)
        if c == 0:
            return band
        return BlockSpec(block=band.block, period=band.period, row_len=c, tile_cols=min(int(tile_cols), c))

    @staticmethod
    def matrices(shape, *, matrix_dims: int | None = None) -> BlockSpec:
        """Whole matrices, computed on an owner rank. ``[..., R, C]`` stacks give one block per trailing matrix;
        ``matrix_dims=None`` with ndim > 3 (a conv weight) flattens everything after dim 0 into one matrix."""
        shape = tuple(shape)
        numel = max(1, math.prod(shape))
        if len(shape) <= 1 or len(shape) > 3:
            per = numel
            cols = math.prod(shape[1:]) if len(shape) > 1 else 0
        else:
            per = max(1, shape[-2] * shape[-1])
            cols = shape[-1]
        return BlockSpec(block=per, period=per, owner_computed=True, row_len=cols)

    def block_shape(self, start: int, end: int) -> tuple[int, ...]:
        """The shape an optimizer views block ``[start, end)`` as: ``(rows, row_len)``, or ``(n,)``."""
        n = end - start
        if self.row_len and n % self.row_len == 0:
            return (n // self.row_len, self.row_len)
        return (n,)

    @property
    def tiles_per_block(self) -> int:
        """Tiles per block (a band of rows) of a tiled spec; 1 otherwise."""
        return -(-self.row_len // self.tile_cols) if self.tile_cols else 1

    def block_index(self, start: int) -> int:
        """The ordinal of the block starting at flat offset ``start`` (blocks counted in flat order); of a tiled
        spec, the index of the band's first tile."""
        per_period = -(-self.period // self.block)
        return ((start // self.period) * per_period + (start % self.period) // self.block) * self.tiles_per_block

    def tile_columns(self) -> list[tuple[int, int]]:
        """``(first column, width)`` of each tile of a band of a tiled spec, left to right."""
        c, t = self.row_len, self.tile_cols
        return [(c0, min(t, c - c0)) for c0 in range(0, c, t)]

    def is_boundary(self, x: int, numel: int) -> bool:
        """True when flat offset ``x`` (0 <= x <= numel) falls between two blocks."""
        return x <= 0 or x >= numel or (x % self.period) % self.block == 0

    def block_of(self, x: int, numel: int) -> tuple[int, int]:
        """The block ``[start, end)`` that holds element ``x``."""
        base = x - (x % self.period)
        start = base + ((x - base) // self.block) * self.block
        end = min(start + self.block, base + self.period, numel)
        return start, end


@dataclass(frozen=True)
class OwnedBlock:
    """A block computed whole on ``owner``: tensor-local element range ``[start, end)``."""

    start: int
    end: int
    owner: int
    split: bool  # True: a locally-computed block that a rank boundary cuts


@dataclass
class Layout:
    """A plan for one unit. Produced by ``plan_unit``; read by the runtime and the optimizers."""

    world_size: int
    shard_size: int  # S, elements per rank
    itemsize: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    specs: tuple[BlockSpec, ...]
    offsets: tuple[int, ...]
    # Per tensor: blocks that one owner computes whole (owner-computed specs, and split blocks).
    owned_blocks: tuple[tuple[OwnedBlock, ...], ...] = field(default=())

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def total_size(self) -> int:
        return self.world_size * self.shard_size

    def local_range(self, rank: int, i: int) -> tuple[int, int]:
        """Rank's piece of tensor i as a tensor-local element range ``[lo, hi)`` (empty when lo == hi)."""
        off, n = self.offsets[i], math.prod(self.shapes[i])
        r0, r1 = rank * self.shard_size, (rank + 1) * self.shard_size
        lo, hi = max(off, r0), min(off + n, r1)
        if hi <= lo:
            return 0, 0
        return lo - off, hi - off

    def ranks_of(self, i: int, start: int, end: int) -> range:
        """The ranks that hold some of tensor i's elements ``[start, end)``."""
        a = self.offsets[i] + start
        b = self.offsets[i] + end
        if b <= a:
            return range(0)
        return range(a // self.shard_size, (b - 1) // self.shard_size + 1)
