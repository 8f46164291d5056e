"""What each optimizer state entry is: declared by the optimizer, read by every save and load path.

An optimizer keeps a dict of state entries per param. Where the param is sharded, the local value of an entry is one
of three kinds, and that kind (never the entry's name or shape) says how it is saved and resharded:

- :class:`Elem`: one value per element of the param, a tensor with the elements of the param's local piece
  (momentum, Adam's moments). Saved at the param's full shape, each rank writing its own elements.
- :class:`Blocks`: state of the blocks of ``spec`` (the param's block spec) that this rank computes. ``form``:
  ``"dict"`` (the default): ``{block index: value}``, a value being a tensor, a list of tensors, or a dict of names
  to those (or to numbers); each block's entry lives on the rank that computes the block (Shampoo's and SOAP's
  bands, a user's per-tile state). ``"value"``: a 1-D tensor with one value per block this rank computes (8-bit
  scales). ``"element"``: a 1-D tensor with the elements of the blocks this rank computes (8-bit codes: on FSDP2
  params a rank computes whole blocks, which are not its rows). Both in the order of the optimizer's
  ``block_state_ranges`` (``blocks_computed_here`` order by default). Saved as one tensor over all blocks (of
  ``[n_blocks]``, or of the param's full shape), or as one entry per block.
- :class:`Replicated`: the same on every rank: a step counter, a number, a flag. Saved once, loaded as it is.

:func:`default_kind` is the schema of an entry nobody declared (and of every entry of a torch optimizer): a tensor
with the elements of the param's local piece is :class:`Elem`, a 0-d tensor or a Python number is
:class:`Replicated`; anything else is not covered, and our optimizers refuse to save it (a dict of tensors kept
under an undeclared key was saved as one opaque object and loaded whole on every rank: wrong after a reshard).

This module is data only (no optimizer code): the sharding layer's state-dict hooks read it, and so do the
optimizer layer's conversions and checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

import torch

from ragged_optim.sharding.layout import BlockSpec

__all__ = [
    "BLOCK_FORMS",
    "Blocks",
    "Elem",
    "Replicated",
    "StateKind",
    "as_kind",
    "default_kind",
    "kind_from_record",
    "n_blocks",
]

BLOCK_FORMS = ("dict", "value", "element")


@dataclass(frozen=True)
class Elem:
    """One value per element of the param: a tensor with the elements of its local piece (``ro.local(p)``)."""

    def record(self) -> tuple:
        return ("Elem",)

    def __str__(self) -> str:
        return "Elem()"


@dataclass(frozen=True)
class Replicated:
    """The same value on every rank (a step counter, a number, a flag): saved once, loaded as it is."""

    def record(self) -> tuple:
        return ("Replicated",)

    def __str__(self) -> str:
        return "Replicated()"


@dataclass(frozen=True)
class Blocks:
    """State of the blocks of ``spec`` (the param's ``block_spec``) this rank computes; ``form`` is ``"dict"``
    (``{block index: tensor, list or dict of tensors}``), ``"value"`` (one value per block, a 1-D tensor) or
    ``"element"`` (the blocks' elements, a 1-D tensor). See the module doc."""

    spec: BlockSpec
    form: str = "dict"

    def __post_init__(self) -> None:
        if not isinstance(self.spec, BlockSpec):
            raise TypeError(
                f"Blocks(spec, ...): spec must be a ragged_optim.BlockSpec (the param's block_spec), got "
                f"{type(self.spec).__name__}: {self.spec!r}"
            )
        if self.form not in BLOCK_FORMS:
            raise ValueError(f"Blocks(..., form={self.form!r}): form must be one of {BLOCK_FORMS}")

    def record(self) -> tuple:
        s = self.spec
        rec = ("Blocks", self.form, s.block, s.period, s.owner_computed)
        return (*rec, s.row_len, s.tile_cols) if s.tile_cols else rec

    def __str__(self) -> str:
        s = self.spec
        tiles = f", row_len={s.row_len}, tile_cols={s.tile_cols}" if s.tile_cols else ""
        return f"Blocks(BlockSpec(block={s.block}, period={s.period}{tiles}), form={self.form!r})"


StateKind = Union[Elem, Blocks, Replicated]  # noqa: UP007  (a runtime alias: isinstance-free, readable in docs)


def as_kind(value: Any, where: str) -> StateKind:
    """A declared kind (``Elem()``, ``Replicated()``, ``Blocks(...)``; the classes ``Elem`` and ``Replicated`` stand
    for their instances), or a TypeError naming ``where``."""
    if value is Elem or value is Replicated:
        return value()
    if isinstance(value, Elem | Blocks | Replicated):
        return value
    raise TypeError(
        f"{where} is {value!r} of type {type(value).__name__}; a state kind is ro.Elem(), ro.Replicated() or "
        "ro.Blocks(spec, form=...)"
    )


def kind_from_record(rec: Any) -> StateKind | None:
    """The kind a checkpoint recorded (:meth:`record`), or None for a record this version does not know."""
    if not isinstance(rec, tuple | list) or not rec:
        return None
    if rec[0] == "Elem":
        return Elem()
    if rec[0] == "Replicated":
        return Replicated()
    if rec[0] == "Blocks" and len(rec) == 5:
        _, form, block, period, owner = rec
        return Blocks(BlockSpec(block=block, period=period, owner_computed=owner), form)
    if rec[0] == "Blocks" and len(rec) == 7:  # a tiled spec
        _, form, block, period, owner, row_len, tile_cols = rec
        return Blocks(BlockSpec(block, period, owner, row_len=row_len, tile_cols=tile_cols), form)
    return None


def n_blocks(spec: BlockSpec, numel: int) -> int:
    """How many blocks of ``spec`` a param of ``numel`` elements has (their indices are ``0 .. n - 1``)."""
    if numel <= 0:
        return 0
    return spec.block_index(spec.block_of(numel - 1, numel)[0]) + spec.tiles_per_block


_SCALARS = (int, float, bool, complex, str, type(None))


def default_kind(key: str, value: Any, local_shape, full_shape) -> StateKind | None:
    """The kind of an entry no declaration covers (every entry of a torch optimizer): a tensor shaped like the
    param's local piece or its full shape (a state dict's), or with the local piece's elements, is :class:`Elem`;
    a 0-d tensor or a Python number, string, bool or None is :class:`Replicated`; anything else None (not
    covered). A 0-d param's moments are 0-d like a step counter: there every 0-d tensor but torch's ``step`` is
    one value per element."""
    if isinstance(value, _SCALARS):
        return Replicated()
    if not isinstance(value, torch.Tensor):
        return None
    local_shape, full_shape = tuple(local_shape), tuple(full_shape)
    if value.dim() == 0:
        return Elem() if full_shape == () and key != "step" else Replicated()
    if tuple(value.shape) in (local_shape, full_shape) or value.numel() == math.prod(local_shape):
        return Elem()
    return None
