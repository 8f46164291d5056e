"""Shampoo with blocked preconditioners and grafting, on plain tensors and on ragged-sharded (RaggedShard) params.

The math of one step, for a param viewed as a matrix ``[d0, prod(rest)]`` and tiled into blocks of at most
``B x B`` (``B = max_preconditioner_dim``), follows the published distributed Shampoo (Shi et al., 2023):

1. decoupled weight decay: ``p *= 1 - lr * weight_decay``;
2. per tile ``G`` (r x c): ``L = beta2 * L + w * G G^T``, ``R = beta2 * R + w * G^T G`` with ``w = 1 - beta2``
   (``w = 1`` and a plain sum when ``beta2 == 1``);
3. every ``precondition_frequency`` steps: ``L^-a``, ``R^-a`` with ``a = 1 / (2 * order) = 1/4`` for matrices
   (``exponent_override`` replaces a), of ``L + epsilon * I`` (:mod:`ragged_optim.kernels.matrix_root`);
4. from ``start_preconditioning_step`` on: ``P = L^-a G R^-a``, rescaled per tile to the Frobenius norm of the
   grafted method's update ``D`` (``P * ||D|| / ||P||``; no rescaling with ``grafting=None``); before it the
   update is ``D`` itself (the gradient with ``grafting=None`` or ``"sgd"``);
5. momentum on the update: ``m = beta1 * m + (1 - beta1) * U``, ``U = m / (1 - beta1^t)`` (skipped when
   ``beta1 == 0``), and ``p -= lr * U``.

1-D params (biases, norm gains) and 0-D scalars are not tiled: they take the grafted method's update (steps 4-5
with ``P = D``); with ``grafting=None`` they take a diagonal Shampoo (AdaGrad-like) preconditioner,
``d = beta2 * d + w * g^2``, ``U = g * (d + epsilon)^-a1`` with ``a1 = 1/2`` (or ``exponent_override``). Both are
elementwise, so they run on any shard as they are.

Placement (ragged-sharded params). Each band of B rows of the matrix view is one layout block
(``BlockSpec(block=B * cols, period=numel)``, requested in ``__init__``), so the planner keeps bands whole on one
rank: a rank computes the B x B tiles of every band it holds whole, with no communication, and keeps their
factor and root matrices. A band the planner had to cut (``split=True`` in ``layout.owned_blocks``) is
owner-computed: its gradient is gathered to its owner, the owner updates that band's factors and roots and
computes the band's update, and the update is scattered back; all split bands of one step and process group move
in one ``all_to_all`` each way (none when nothing is split). Who computes which band is balanced by its state
(``block_cost``: factors and roots of ``rows^2 + cols^2`` per tile, not proportional to the band's elements): a
rank whose bands would keep more than 10% over the mean gives whole bands to less loaded ranks, which compute them
through the same exchange (``balance_whole_blocks``). Every band's state lives on exactly one rank and
every band is computed by exactly the same op sequence as on one process, so results do not depend on the world
size (tests/optim/shampoo/test_shampoo_sharded.py).

Placement (torch ``DTensor`` params; FSDP2's ``Shard(0)`` on a 1-D mesh here, any placements on any mesh in
docs/parallelism.md). A rank holds a chunk of whole rows, a ragged
range of the flattened param that no planner chose: the same bands of B rows are laid over those row-chunk ranges.
A band wholly inside one rank's chunk is computed there with no communication; a band cut by a chunk boundary is
owner-computed (owners balanced greedily, preferring the rank holding most of it) through the same exchange as the
split bands of ragged params: one ``all_to_all`` each way per process group and step for all split bands of both
kinds. Grafting state of a band lives with the band; momentum and weight decay run on the local shard.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ragged_optim.kernels.matrix_root import RootInverseError, matrix_inverse_root
from ragged_optim.optim.bands import BandOptimizer, matrix_view_shape, shampoo_band_spec
from ragged_optim.optim.base import local

__all__ = ["Shampoo", "GRAFTING_METHODS", "shampoo_band_spec", "matrix_view_shape"]

GRAFTING_METHODS = ("adam", "adagrad", "rmsprop", "sgd", None)
ROOT_INVERSE_METHODS = ("eigh", "newton")


def _tile_groups(cols: int, B: int) -> list[tuple[int, int, int]]:
    """Column tiles of a band as ``(first column, count, width)`` groups of equal width."""
    full, tail = divmod(cols, B)
    groups = []
    if full:
        groups.append((0, full, B))
    if tail:
        groups.append((full * B, 1, tail))
    return groups


def _factor_weight(beta2: float) -> float:
    return 1.0 if beta2 == 1.0 else 1.0 - beta2


def _graft_direction(g: Tensor, state: dict, t: int, hp: dict) -> Tensor:
    """The grafted method's update for ``g`` (elementwise; its accumulator lives in ``state['graft']``)."""
    method = hp["grafting"]
    if method is None or method == "sgd":
        return g
    acc = state.get("graft")
    if acc is None:
        acc = state["graft"] = torch.zeros_like(g)
    eps, b2 = hp["grafting_epsilon"], hp["grafting_beta2"]
    if method == "adagrad":
        acc.addcmul_(g, g)
        denom = acc.sqrt()
    else:  # rmsprop, adam; beta2 = 1 sums, as the factor matrices do (an EMA of weight 0 never moved from 0)
        if b2 != 1.0:
            acc.mul_(b2)
        acc.addcmul_(g, g, value=_factor_weight(b2))
        denom = acc.sqrt()
        if method == "adam" and b2 != 1.0:
            denom = denom / math.sqrt(1 - b2**t)
    return g / denom.add_(eps)


def start_step(hp: dict) -> int:
    """The first preconditioned step: ``start_preconditioning_step``, or (None) the group's current
    ``precondition_frequency``, the first step whose roots exist."""
    s = hp["start_preconditioning_step"]
    return hp["precondition_frequency"] if s is None else s


def _exponent(hp: dict, order: int) -> float:
    return hp["exponent_override"] if hp["exponent_override"] is not None else 1.0 / (2 * order)


def _new_band_state(rows: int, cols: int, B: int, device) -> dict:
    st: dict[str, Any] = {"L": [], "R": [], "L_root": [], "R_root": []}
    for _, n, w in _tile_groups(cols, B):
        for key, d in (("L", rows), ("R", w)):
            st[key].append(torch.zeros(n, d, d, dtype=torch.float32, device=device))
            st[key + "_root"].append(torch.zeros(n, d, d, dtype=torch.float32, device=device))
    return st


def _band_update(g: Tensor, st: dict, t: int, hp: dict, label: str) -> Tensor:
    """The update of one band ``g`` (``[rows, cols]`` float32) at step t: factors, roots, preconditioning and
    grafting of each of its tiles. Pure per-band math: the same op sequence wherever the band is computed."""
    rows, cols = g.shape
    B = hp["max_preconditioner_dim"]
    beta2 = hp["betas"][1]
    weight = _factor_weight(beta2)
    alpha = _exponent(hp, 2)
    direction = _graft_direction(g, st, t, hp)
    precondition = t >= start_step(hp)
    recompute = t % hp["precondition_frequency"] == 0
    out = torch.empty_like(g) if precondition else direction
    for gi, (c0, n, w) in enumerate(_tile_groups(cols, B)):
        tiles = g[:, c0 : c0 + n * w].reshape(rows, n, w).transpose(0, 1)  # [n, rows, w]
        L, R = st["L"][gi], st["R"][gi]
        if beta2 != 1.0:
            L.mul_(beta2)
            R.mul_(beta2)
        L.baddbmm_(tiles, tiles.mT, alpha=weight)
        R.baddbmm_(tiles.mT, tiles, alpha=weight)
        if recompute:
            for key, stat in (("L_root", L), ("R_root", R)):
                try:
                    st[key][gi] = matrix_inverse_root(stat, alpha, hp["epsilon"], hp["root_inverse"])
                except RootInverseError as e:
                    warnings.warn(f"Shampoo: {label}: {e}; keeping the previous root", RuntimeWarning, stacklevel=3)
        if not precondition:
            continue
        p = st["L_root"][gi] @ tiles @ st["R_root"][gi]
        if hp["grafting"] is not None:
            d = direction[:, c0 : c0 + n * w].reshape(rows, n, w).transpose(0, 1)
            p_norm = torch.linalg.matrix_norm(p, keepdim=True)
            d_norm = torch.linalg.matrix_norm(d, keepdim=True)
            scale = torch.where(p_norm > 0, d_norm / p_norm.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
            p = p * scale
        out[:, c0 : c0 + n * w] = p.transpose(0, 1).reshape(rows, n * w)
    return out


def _vector_update(g: Tensor, state: dict, t: int, hp: dict) -> Tensor:
    """The update of a 1-D or 0-D param (or its local shard): elementwise."""
    if hp["grafting"] is not None:
        return _graft_direction(g, state, t, hp)
    diag = state.get("diag")
    if diag is None:
        diag = state["diag"] = torch.zeros_like(g)
    beta2 = hp["betas"][1]
    if beta2 != 1.0:
        diag.mul_(beta2)
    diag.addcmul_(g, g, value=_factor_weight(beta2))
    if t < start_step(hp):
        return g
    return g * (diag + hp["epsilon"]).pow(-_exponent(hp, 1))


class Shampoo(BandOptimizer):
    """Shampoo with blocked Kronecker-factored preconditioners and grafting (the published distributed Shampoo
    semantics), for plain tensors, ``ragged_optim.fully_shard`` params and torch ``DTensor`` params (FSDP2's
    ``Shard(0)``, FSDP2 + TP, HSDP + TP: docs/parallelism.md). See docs/shampoo.md.

    Args:
        params: tensors or param groups (any key below may be set per group).
        lr: learning rate.
        betas: ``(beta1, beta2)``. beta1: momentum (an EMA with bias correction) on the final, grafted update;
            0 disables it. beta2: EMA factor of the factor matrices ``L``/``R`` (``L = beta2 L + (1-beta2) G G^T``);
            ``beta2 == 1`` accumulates a plain sum ``L += G G^T`` (AdaGrad-style Shampoo, the default).
        epsilon: ``epsilon * I`` is added to each factor matrix before its inverse root, so rank-deficient (or
            all-zero) statistics give finite roots.
        weight_decay: decoupled weight decay, ``p *= 1 - lr * weight_decay`` before the update.
        max_preconditioner_dim: B. Matrices (``[d0, prod(rest)]`` views of params with ndim >= 2) are cut into
            bands of B rows and each band into tiles of at most B columns; every tile has its own ``L`` (rows x
            rows) and ``R`` (cols x cols). On ragged-sharded params each band is one layout block.
        precondition_frequency: the inverse roots are recomputed at steps that are multiples of it (factor
            matrices are updated every step).
        start_preconditioning_step: first step whose update is preconditioned; before it the grafted method's
            update is used alone. ``None`` means ``precondition_frequency`` (as it is at each step); it must be >=
            that (so the roots exist when first used), at construction and at every step.
        grafting: ``"adam"``, ``"adagrad"``, ``"rmsprop"``, ``"sgd"`` or ``None``. Each tile's preconditioned
            update is rescaled to the Frobenius norm of this elementwise method's update for the tile (the
            layer-wise learning-rate schedule of the grafted method, the direction of Shampoo). ``None``: no
            rescaling (and plain gradient steps before ``start_preconditioning_step``).
        grafting_beta2: EMA factor of the rmsprop/adam second moment (adagrad sums; so does 1.0, with no bias
            correction).
        grafting_epsilon: added to the square root of the grafted second moment.
        root_inverse: ``"eigh"`` (eigendecomposition in float32, float64 retry on failure) or ``"newton"`` (the
            coupled Newton iteration in float32; needs the exponent to be 1/p for an integer p).
        exponent_override: replaces the root exponent ``1/(2 * order)`` (1/4 for matrices, 1/2 for the diagonal
            preconditioner of 1-D params without grafting): the roots are ``L^-e``, ``R^-e``.

    1-D and 0-D params take the grafted method's update (a diagonal AdaGrad-like preconditioner with
    ``grafting=None``). State per matrix param: ``step``, ``momentum`` (local elements) and ``bands``: for each
    band computed on this rank, ``L``, ``R``, ``L_root``, ``R_root`` (lists of ``[tiles, d, d]`` stacks, one per
    tile width), ``graft`` (the band's grafting accumulator) and ``step`` (the step the band was last updated at: a
    load refuses bands of another run). Params whose grad is None are skipped.
    """

    epsilon_key = "epsilon"
    epsilon_purpose = "it keeps the inverse roots finite"
    more_real_keys = ("grafting_beta2", "grafting_epsilon")
    #: ``momentum``, and a vector's ``graft`` / ``diag`` (declared for matrices too: theirs live in their bands)
    matrix_elementwise_keys = vector_elementwise_keys = ("momentum", "graft", "diag")
    revalidates_groups_at_step = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | None = None,
        grafting: str | None = "adam",
        grafting_beta2: float = 0.999,
        grafting_epsilon: float = 1e-10,
        root_inverse: str = "eigh",
        exponent_override: float | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            epsilon=epsilon,
            weight_decay=weight_decay,
            max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            grafting=grafting,
            grafting_beta2=grafting_beta2,
            grafting_epsilon=grafting_epsilon,
            root_inverse=root_inverse,
            exponent_override=exponent_override,
        )
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ hyperparameters

    def _check_betas(self, g: dict[str, Any]) -> None:
        b1, b2 = g["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 < b2 <= 1.0):
            raise ValueError(f"betas must satisfy 0 <= beta1 < 1 and 0 < beta2 <= 1, got {g['betas']}")

    def _check_own_keys(self, g: dict[str, Any]) -> None:
        f = g["precondition_frequency"]
        s = g["start_preconditioning_step"]  # None: the frequency, read at each step (it may be changed later)
        if s is not None and (not isinstance(s, int) or isinstance(s, bool) or s < f):  # (True is an int)
            raise ValueError(
                f"start_preconditioning_step must be an int >= precondition_frequency ({f}) so that the roots "
                f"exist when first used, got {s!r}"
            )
        if g["grafting"] not in GRAFTING_METHODS:
            raise ValueError(f"grafting must be one of {GRAFTING_METHODS}, got {g['grafting']!r}")
        if not 0.0 < g["grafting_beta2"] <= 1.0:
            raise ValueError(f"grafting_beta2 must be in (0, 1], got {g['grafting_beta2']}")
        if not g["grafting_epsilon"] > 0.0:
            raise ValueError(f"grafting_epsilon must be > 0, got {g['grafting_epsilon']}")
        if g["root_inverse"] not in ROOT_INVERSE_METHODS:
            raise ValueError(f"root_inverse must be one of {ROOT_INVERSE_METHODS}, got {g['root_inverse']!r}")
        e = g["exponent_override"]
        if e is not None and not (isinstance(e, int | float) and not isinstance(e, bool) and e > 0):
            raise ValueError(f"exponent_override must be None or a number > 0, got {e!r}")
        if g["root_inverse"] == "newton":
            for alpha in (e,) if e is not None else (0.25, 0.5):
                if abs(1 / alpha - round(1 / alpha)) > 1e-9:
                    raise ValueError(
                        f"root_inverse='newton' computes A^(-1/p) for an integer p; exponent {alpha} is not 1/p: "
                        "use root_inverse='eigh' for it"
                    )

    # ------------------------------------------------------------------ band state

    def _state_dtype(self, p: Tensor) -> torch.dtype:
        return torch.float32  # statistics, roots, momentum and grafting state, whatever the param's dtype

    def _preconditioner_tensors(self, band: dict) -> list[Tensor]:
        """The factor and root matrices (not the grafting state)."""
        return [t for key in ("L", "R", "L_root", "R_root") for t in band[key]]

    def _band_state_elements(self, rows: int, cols: int, numel: int, group: dict) -> int:
        """``L``, ``R`` and their roots per tile, and the grafting accumulator. For full ``B x B`` tiles it is
        proportional to the per-step work as well."""
        factors = sum(n * (rows * rows + w * w) for _, n, w in _tile_groups(cols, group["max_preconditioner_dim"]))
        return 2 * factors + (numel if group["grafting"] not in (None, "sgd") else 0)

    def _band_step(self, g: Tensor, bands: dict, k: int, step: int, group: dict, label: str) -> Tensor:
        if k not in bands:
            bands[k] = _new_band_state(*g.shape, group["max_preconditioner_dim"], g.device)
        return _band_update(g, bands[k], step, group, label)

    # ------------------------------------------------------------------ elementwise

    def _vector_direction(self, p: Tensor, grad: Tensor, state: dict, group: dict) -> Tensor:
        return _vector_update(grad.to(torch.float32), state, int(state["step"].item()), group)

    def _apply(self, p: Tensor, u: Tensor, group: dict) -> None:  # type: ignore[override]
        """Momentum (elementwise on local elements), decoupled weight decay and the lr step."""
        state = self.state[p]
        lp = local(p)
        u = u.reshape(lp.shape)
        beta1 = group["betas"][0]
        if beta1 > 0:
            if "momentum" not in state:
                state["momentum"] = torch.zeros(lp.shape, dtype=torch.float32, device=lp.device)
            m = state["momentum"]
            m.mul_(beta1).add_(u, alpha=1 - beta1)
            u = m / (1 - beta1 ** int(state["step"].item()))
        lr = self._group_lr(group)
        if group["weight_decay"] != 0:
            lp.mul_(1 - lr * group["weight_decay"])
        lp.add_(u.to(lp.dtype), alpha=-lr)
