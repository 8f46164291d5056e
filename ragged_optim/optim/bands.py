"""The base class of the optimizers that precondition bands of a matrix (Shampoo, SOAP): everything but the band math.

A param with ndim >= 2 is viewed as the matrix ``[d0, prod(rest)]`` and cut into bands of ``B =
max_preconditioner_dim`` rows; each band is one layout block of the sharding layer, so it is computed whole on one
rank with the same op sequence wherever it sits, and its state lives with it (``state[p]["bands"][k]``). 1-D and
0-D params take an elementwise update on their local elements. A subclass supplies the band math
(:meth:`BandOptimizer._band_step`), the elementwise update of vectors (``_vector_direction``), how a direction is
applied (``_apply``) and its hyperparameters; this class owns the param and grad checks, the step skeleton, the
block API calls (which rank computes which band, the exchange of cut bands) and the per-band bookkeeping.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ragged_optim.optim.base import full_shape, is_dtensor, local
from ragged_optim.optim.optimizer import RaggedOptimizer, check_int, check_real, check_reals
from ragged_optim.sharding import BlockSpec
from ragged_optim.sharding.state_schema import Blocks, Elem, Replicated

__all__ = ["BandOptimizer", "matrix_view_shape", "shampoo_band_spec"]


def matrix_view_shape(shape) -> tuple[int, int]:
    """The ``[d0, prod(rest)]`` matrix a param of ``shape`` (ndim >= 2) is preconditioned as."""
    shape = tuple(shape)
    return int(shape[0]), int(math.prod(shape[1:]))


def shampoo_band_spec(shape, max_preconditioner_dim: int) -> BlockSpec:
    """The layout block of a matrix param: bands of ``max_preconditioner_dim`` rows of its matrix view."""
    return BlockSpec.rows(max_preconditioner_dim, matrix_view_shape(shape))


class BandOptimizer(RaggedOptimizer):
    """A :class:`RaggedOptimizer` that computes matrix params band by band (bands of ``max_preconditioner_dim``
    rows of the ``[d0, prod(rest)]`` view) and 1-D and 0-D params elementwise. Params must be real, floating and
    non-empty (DTensors without ``Partial`` placements); grads dense and real. Errors name the optimizer class.

    Subclasses give the band math and the hyperparameters: ``_band_step``, ``_vector_direction``, ``_apply``,
    ``_check_betas``, ``_check_own_keys``, ``_band_state_elements``, ``_preconditioner_tensors``, ``_state_dtype``
    and the class attributes below."""

    layout_keys = ("max_preconditioner_dim",)

    #: Bands a rank holds whole may be computed elsewhere: a band's state is not proportional to its elements, so
    #: owners are balanced by ``block_cost`` (balancing only the elements, the planner's, left 2.3x the Shampoo
    #: state on one rank).
    balance_whole_blocks = True

    #: the group key of the epsilon that must be > 0, and what it is for (said in its error message)
    epsilon_key: str
    epsilon_purpose: str
    #: more real-number hyperparameters, type-checked with the epsilon and the weight decay
    more_real_keys: tuple[str, ...] = ()
    #: state keys of one value per local element, declared for matrix params and for 1-D and 0-D params
    matrix_elementwise_keys: tuple[str, ...] = ()
    vector_elementwise_keys: tuple[str, ...] = ()
    #: check every group's hyperparameters again at each step, before anything is updated (Shampoo's
    #: ``start_preconditioning_step=None`` follows ``precondition_frequency`` as it is at each step)
    revalidates_groups_at_step = False
    #: grads are cast to the state dtype before the block exchange, so cut bands travel in it; else they travel in
    #: their own dtype (half the bytes for bf16) and each band is cast where it is computed
    grads_travel_in_state_dtype = False

    # ------------------------------------------------------------------ params and grads

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then the group's hyperparameters (``_validate_group``) and params checked; a group that fails
        is removed again, so a refused group leaves the optimizer as it was."""
        if isinstance(param_group.get("params"), set):
            raise TypeError(f"{type(self).__name__} params must be an ordered collection (a list), not a set")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._validate_group(group)
            self._check_params(len(self.param_groups) - 1, group)
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    def _check_params(self, gi: int, group: dict[str, Any]) -> None:
        name = type(self).__name__
        for i, p in enumerate(group["params"]):
            if is_dtensor(p):
                self._check_dtensor(gi, i, p)
            if p.is_complex():
                raise ValueError(
                    f"{self._param_label(gi, i)} is complex ({p.dtype}); {name} supports real params only: view it "
                    "as real (torch.view_as_real) in the model, or optimize it with torch.optim.Adam."
                )
            if not p.is_floating_point():
                raise ValueError(f"{self._param_label(gi, i)} has dtype {p.dtype}; {name} needs floating params")
            if math.prod(full_shape(p)) == 0:
                raise ValueError(
                    f"{self._param_label(gi, i)} has no elements; {name} has nothing to precondition. Leave it out "
                    "of the optimizer (it has nothing to learn)."
                )

    def _grad_of(self, gi: int, i: int, p: Tensor) -> Tensor | None:
        grad = super()._grad_of(gi, i, p)
        if grad is None:
            return None
        if grad.is_complex():
            raise ValueError(
                f"{self._param_label(gi, i)} has a complex gradient; {type(self).__name__} supports real params only"
            )
        return local(grad)

    # ------------------------------------------------------------------ hyperparameters

    def _validate_group(self, g: dict[str, Any]) -> None:  # type: ignore[override]
        if not check_real("lr", g["lr"], tensor=True) >= 0.0:
            raise ValueError(f"lr must be >= 0, got {g['lr']}")
        g["betas"] = check_reals("betas", g["betas"], "(beta1, beta2)")
        self._check_betas(g)
        eps = self.epsilon_key
        for k in (eps, "weight_decay", *self.more_real_keys):
            check_real(k, g[k])
        if not g[eps] > 0.0:
            raise ValueError(f"{eps} must be > 0 ({self.epsilon_purpose}), got {g[eps]}")
        if not g["weight_decay"] >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")
        for k in ("max_preconditioner_dim", "precondition_frequency"):
            check_int(k, g[k], 1)
        self._check_own_keys(g)

    def _check_betas(self, g: dict[str, Any]) -> None:
        """The ranges of ``g["betas"]`` (already a tuple of two reals) and of any other EMA factor."""
        raise NotImplementedError

    def _check_own_keys(self, g: dict[str, Any]) -> None:
        """The subclass's remaining hyperparameters, after the shared ones have passed."""

    # ------------------------------------------------------------------ state

    def _state_keys(self, group: dict[str, Any], p: Tensor) -> tuple[str, ...]:
        return ("step",)  # the rest is created when missing

    def state_schema(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """``step``: replicated; the elementwise state keys: one value per element; a matrix's ``bands``: one dict
        of band state per band (block) of its block spec."""
        spec = self.block_spec(p, group)
        keys = self.vector_elementwise_keys if spec is None else self.matrix_elementwise_keys
        schema: dict[str, Any] = {"step": Replicated(), **{k: Elem() for k in keys}}
        if spec is not None:
            schema["bands"] = Blocks(spec)
        return schema

    def _state_dtype(self, p: Tensor) -> torch.dtype:
        """The dtype of the band state and of the band math for ``p`` (whatever the param's own dtype)."""
        raise NotImplementedError

    def preconditioner_bytes(self) -> int:
        """Bytes of the band state this rank holds that ``_preconditioner_tensors`` names (its share of the
        preconditioner memory)."""
        return sum(
            t.numel() * t.element_size()
            for st in self.state.values()
            for band in st.get("bands", {}).values()
            for t in self._preconditioner_tensors(band)
        )

    def _preconditioner_tensors(self, band: dict) -> Iterable[Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ bands

    def block_spec(self, p: Tensor, group: dict[str, Any]) -> BlockSpec | None:
        """Matrix params compute on bands of ``max_preconditioner_dim`` rows; 1-D and 0-D params are elementwise."""
        if len(full_shape(p)) < 2:
            return None
        return shampoo_band_spec(full_shape(p), group["max_preconditioner_dim"])

    def block_cost(self, p: Tensor, spec: BlockSpec, numel: int) -> float:
        """The elements of a band's state (``_band_state_elements``): what owners are balanced by."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        cols = matrix_view_shape(full_shape(p))[1]
        return float(self._band_state_elements(numel // cols, cols, numel, group))

    def _band_state_elements(self, rows: int, cols: int, numel: int, group: dict) -> int:
        raise NotImplementedError

    def _compute_band(self, p: Tensor, k: int, g_flat: Tensor, group: dict, label: str) -> Tensor:
        """The flat result of band ``k`` of ``p`` from its flat gradient: the subclass's band math on a copy in the
        state dtype, then the band stamped with the step it was last updated at (a load refuses other runs')."""
        cols = matrix_view_shape(full_shape(p))[1]
        # A fresh copy: matmul kernels can round differently for a view at another memory offset, and an inverse
        # root amplifies that; a band must compute the same bits wherever it sits in a shard.
        g = g_flat.to(self._state_dtype(p), copy=True).reshape(-1, cols)
        bands = self.state[p].setdefault("bands", {})
        out = self._band_step(g, bands, k, int(self.state[p]["step"].item()), group, f"{label} band {k}")
        bands[k]["step"] = self.state[p]["step"].clone()
        return out.reshape(-1)

    def _band_step(self, g: Tensor, bands: dict, k: int, step: int, group: dict, label: str) -> Tensor:
        """The result of band ``k`` (gradient ``g``, ``[rows, cols]`` in the state dtype) at the param's ``step``;
        creates ``bands[k]`` when missing and updates it in place."""
        raise NotImplementedError

    def _matrix_directions(self, items: list[tuple]) -> list[Tensor]:
        """Per item ``(p, grad_local, group, label)``: the result of p's local elements, in the state dtype, through
        the block API: bands this rank holds whole are computed in place; cut bands (a planner's split, a DTensor
        row-chunk boundary, or a band balanced away) are gathered to their owner, computed there and scattered
        back: one all_to_all each way per process group and state dtype."""
        info = {id(p): (group, label) for p, _, group, label in items}

        def compute(blocks):
            return [self._compute_band(b.param, b.index, b.value.reshape(-1), *info[id(b.param)]) for b in blocks]

        out: list[Tensor | None] = [None] * len(items)
        for dtype in sorted({self._state_dtype(p) for p, *_ in items}, key=str):  # the same order on every rank
            ks = [k for k, (p, *_) in enumerate(items) if self._state_dtype(p) == dtype]
            grads = [items[k][1].to(dtype) if self.grads_travel_in_state_dtype else items[k][1] for k in ks]
            # out_dtype: a param computed as one band keeps its band's result, with no zero-filled copy
            res = self.map_blocks(compute, [items[k][0] for k in ks], grads, out_dtype=dtype)
            for k, r in zip(ks, res):
                out[k] = r
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ step

    # torch.compile(opt.step) runs it eagerly: dynamo fails inside it (on the block API's closures)
    # and the step is whole-matrix ops
    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One optimizer step; ``closure`` (optional) re-evaluates the model and returns the loss."""
        if self.revalidates_groups_at_step:
            for gi, group in enumerate(self.param_groups):
                try:
                    self._validate_group(group)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"{type(self).__name__}.step(): param_groups[{gi}]: {e}; nothing was updated") from e
        loss, skip = self._begin_step(closure)
        if skip:
            return loss
        todo: list[tuple[Tensor, dict, Tensor | None]] = []  # (param, group, local direction or None)
        matrices: list[tuple] = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                grad = self._grad_of(gi, i, p)
                if grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
                state["step"] += 1
                if len(full_shape(p)) >= 2:
                    matrices.append((p, grad, group, self._param_label(gi, i)))
                else:
                    todo.append((p, group, self._vector_direction(p, grad, state, group)))
        if matrices:
            for (p, _, group, _), d in zip(matrices, self._matrix_directions(matrices)):
                todo.append((p, group, d))
        for p, group, d in todo:
            self._apply(p, d, group)
        return loss

    def _vector_direction(self, p: Tensor, grad: Tensor, state: dict, group: dict) -> Tensor | None:
        """The elementwise result of a 1-D or 0-D param's local ``grad`` (None: nothing to apply this step)."""
        raise NotImplementedError

    def _apply(self, p: Tensor, direction: Tensor | None, group: dict) -> None:
        """Turn p's local result (of ``_matrix_directions`` or ``_vector_direction``) into the param update."""
        raise NotImplementedError
