"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"): Adam run in the eigenbasis of
Shampoo's preconditioner, block by block, on plain tensors, ragged-sharded params and torch FSDP2 DTensor params.

The math of one block ``G`` (``r x c``, float32; float64 for float64 params) at Adam step ``t >= 1``, with
``QL``, ``QR`` the block's eigenbases (``QR = I`` when ``c > max_preconditioner_dim``):

1. ``G' = QL^T G QR`` (the gradient rotated into the current eigenbasis);
2. ``M = b1 M + (1 - b1) G`` (first moment, kept in the original space), ``M' = QL^T M QR``;
3. ``V' = b2 V' + (1 - b2) G'^2`` (second moment, kept in the rotated space);
4. ``N = QL (M' / (sqrt(V') + eps)) QR^T`` (the Adam direction, rotated back); with ``normalize_grads``,
   ``N /= 1e-30 + rms(N)``;
5. ``p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * N`` (no bias correction with ``correct_bias=False``), then decoupled
   weight decay on the updated param, ``p *= 1 - lr * weight_decay``;
6. the Kronecker factors, with the gradient of this step (after it was used above): ``L = lerp(L, G G^T, 1 - sb)``,
   ``R = lerp(R, G^T G, 1 - sb)``, ``sb = shampoo_beta`` (``betas[1]`` when None);
7. when ``t % precondition_frequency == 0``, each basis is refreshed by one power-iteration step: the columns of
   ``Q`` are sorted by their estimated eigenvalues ``diag(Q^T L Q)`` (descending) and ``V'`` is permuted along that
   dim the same way, then ``Q = qr(L Q).Q``.

The first step of a param only accumulates the factors from its gradient and takes their eigenbases with ``eigh``
(columns by descending eigenvalue); it changes neither the param nor the moments, so that no gradient is ever
projected on a basis it helped to build (the reference implementation does the same). 1-D and 0-D params take Adam
(the reference's behaviour without ``precondition_1d``), first step skipped as well.

Where this differs from the reference implementation (nikhilvyas/SOAP ``soap.py``), and why:

- Blocks. A param with ndim >= 2 is viewed as the matrix ``[d0, prod(rest)]`` (the reference keeps one factor per
  tensor dim; we precondition the matrix view, like ``ro.Shampoo``) and cut into bands of ``B =
  max_preconditioner_dim`` rows; each band is a SOAP block of its own, with its own ``L``, ``R``, bases and
  moments. A band is what the sharding layer keeps whole on one rank, so every block is computed where it lives
  and the result does not depend on the world size. For ``d0 <= B`` the block is the whole matrix view and the
  math is the reference's for a 2-D param. The reference instead leaves a dim above its limit unpreconditioned: we
  do the same for the columns (``prod(rest) > B``: ``QR = I``) but give rows above ``B`` band-local left factors.
- ``normalize_grads`` normalises each band's direction (the reference: each param's).
- ``merge_dims``, ``precondition_1d`` and ``data_format`` are not offered.
- Statistics and bases are kept in float32 for 16/32-bit params (the reference: float32 factors, moments in the
  param's dtype), float64 for float64 params.
- The first moment is kept in the original space and rotated each step; the reference keeps it rotated and rotates
  it back and forth around each basis update: the same math, two rotations fewer per step.
- ``eigh`` that fails in float32 is retried in float64 (as the reference); if that fails too the previous basis is
  kept (identity at the first step) with a warning.

Placement. Bands are the layout blocks of the sharding layer, the same bands as ``ro.Shampoo``'s: a rank computes
the bands it holds whole, with no communication, and keeps their state (who computes which band is balanced by
its state, ``block_cost``: a rank over 10% above the mean gives whole bands to others, computed through the same
exchange); a band the planner had to cut (or, on
torch FSDP2 ``Shard(0)`` params, a band a row-chunk boundary cuts) is gathered to its owner, computed there and its
direction scattered back, all such bands of one step and process group in one all_to_all each way. The bias
correction, the lr step and weight decay are elementwise and run on each rank's local elements.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ragged_optim.optim.bands import BandOptimizer, matrix_view_shape
from ragged_optim.optim.base import full_shape, local
from ragged_optim.optim.blocks import all_reduce_over_shards
from ragged_optim.optim.optimizer import check_bool, check_real

__all__ = [
    "SOAP",
    "band_geometry",
    "new_band_state",
    "soap_band_step",
    "eigenbasis",
    "refresh_basis",
]


# ---------------------------------------------------------------------------------------------------- band math


def band_geometry(shape, B: int) -> tuple[int, int, int]:
    """``(rows of the matrix view, cols, rows per band)`` of a param of full ``shape`` (ndim >= 2)."""
    d0, cols = matrix_view_shape(shape)
    return d0, cols, max(1, min(B, d0))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype SOAP's statistics and bases are kept in: float64 for float64 params, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def eigenbasis(factor: Tensor) -> Tensor | None:
    """The eigenvectors of a symmetric factor, as columns by descending eigenvalue; float32 that fails to converge
    is redone in float64. None when both fail."""
    for dtype in dict.fromkeys((factor.dtype, torch.float64)):  # float64 once for a float64 factor
        try:
            _, q = torch.linalg.eigh(factor.to(dtype))
        except torch.linalg.LinAlgError:
            continue
        if torch.isfinite(q).all():
            return q.flip(-1).to(factor.dtype).contiguous()  # (eigh's columns are strided: see refresh_basis)
    return None


def refresh_basis(factor: Tensor, q: Tensor, exp_avg_sq: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """One power-iteration step towards the eigenbasis of ``factor`` from the basis ``q``: columns sorted by
    estimated eigenvalue (descending, ``exp_avg_sq`` permuted along ``dim`` with them), then ``qr(factor @ q)``.
    Returns ``(new basis, permuted exp_avg_sq)``."""
    estimate = torch.diagonal(q.mT @ factor @ q)
    order = torch.argsort(estimate, descending=True, stable=True)
    q_new, _ = torch.linalg.qr(factor @ q[:, order])
    # row-major, as a checkpoint loads it: a matmul's bits may depend on its operands' strides (qr's are not)
    return q_new.contiguous(), exp_avg_sq.index_select(dim, order)


def new_band_state(g: Tensor, B: int, shampoo_beta: float) -> dict[str, Tensor]:
    """A band's state from its first gradient ``g`` (``r x c``, compute dtype): the factors ``L`` (and ``R`` when
    ``c <= B``), their eigenbases ``Q_L`` (``Q_R``), and zero moments ``exp_avg`` (original space) and
    ``exp_avg_sq`` (rotated space). The first step changes nothing else."""
    r, c = g.shape
    st: dict[str, Tensor] = {"exp_avg": torch.zeros_like(g), "exp_avg_sq": torch.zeros_like(g)}
    st["L"] = torch.zeros(r, r, dtype=g.dtype, device=g.device)
    if c <= B:
        st["R"] = torch.zeros(c, c, dtype=g.dtype, device=g.device)
    _accumulate(g, st, shampoo_beta)
    for side in ("L", "R"):
        if side in st:
            q = eigenbasis(st[side])
            st["Q_" + side] = q if q is not None else torch.eye(len(st[side]), dtype=g.dtype, device=g.device)
    return st


def _band_shapes(rows: int, cols: int, B: int) -> dict[str, tuple[int, int]]:
    """The state tensors of a band and their shapes."""
    out = {"L": (rows, rows), "Q_L": (rows, rows), "exp_avg": (rows, cols), "exp_avg_sq": (rows, cols)}
    if cols <= B:
        out.update(R=(cols, cols), Q_R=(cols, cols))
    return out


def _accumulate(g: Tensor, st: dict, shampoo_beta: float) -> None:
    st["L"].lerp_(g @ g.mT, 1 - shampoo_beta)
    if "R" in st:
        st["R"].lerp_(g.mT @ g, 1 - shampoo_beta)


def _rotate(x: Tensor, st: dict) -> Tensor:
    """``QL^T x QR``."""
    y = st["Q_L"].mT @ x
    return y @ st["Q_R"] if "Q_R" in st else y


def _rotate_back(x: Tensor, st: dict) -> Tensor:
    """``QL x QR^T``."""
    y = st["Q_L"] @ x
    return y @ st["Q_R"].mT if "Q_R" in st else y


def soap_band_step(g: Tensor, st: dict, t: int, hp: dict, label: str = "band") -> Tensor:
    """The direction ``N`` of one band at Adam step ``t >= 1`` (before the lr and the bias correction), from its
    gradient ``g`` (``r x c``, compute dtype) and state ``st`` (of :func:`new_band_state`, updated in place: moments,
    factors, and the bases when ``t`` is a multiple of ``precondition_frequency``). The same op sequence wherever
    the band is computed."""
    b1, b2 = hp["betas"]
    m, v = st["exp_avg"], st["exp_avg_sq"]
    g_rot = _rotate(g, st)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g_rot, g_rot, value=1 - b2)
    n = _rotate_back(_rotate(m, st) / (v.sqrt() + hp["eps"]), st)
    if hp["normalize_grads"]:
        n = n / (1e-30 + n.square().mean().sqrt())
    _accumulate(g, st, shampoo_beta_of(hp))
    if t % hp["precondition_frequency"] == 0:
        for dim, side in ((0, "L"), (1, "R")):
            if side in st:
                q, v_sorted = refresh_basis(st[side], st["Q_" + side], st["exp_avg_sq"], dim)
                if torch.isfinite(q).all():
                    st["Q_" + side], st["exp_avg_sq"] = q, v_sorted
                else:
                    warnings.warn(f"SOAP: {label}: the {side} basis refresh is not finite; keeping the previous basis",
                                  RuntimeWarning, stacklevel=2)  # fmt: skip
    return n


def shampoo_beta_of(hp: dict) -> float:
    sb = hp["shampoo_beta"]
    return hp["betas"][1] if sb is None else sb


def adam_direction(g: Tensor, state: dict, hp: dict) -> Tensor:
    """Adam's direction ``M / (sqrt(V) + eps)`` of a 1-D or 0-D param (or its local shard), elementwise; the
    moments live in ``state`` (created at the param's first step, which does not update)."""
    b1, b2 = hp["betas"]
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    return m / (v.sqrt() + hp["eps"])


def step_size(hp: dict, t: int, lr: float) -> float:
    """``lr * sqrt(1 - b2^t) / (1 - b1^t)`` with ``correct_bias``, else ``lr`` (``hp["lr"]`` as a number)."""
    if not hp["correct_bias"]:
        return lr
    b1, b2 = hp["betas"]
    return lr * math.sqrt(1 - b2**t) / (1 - b1**t)


# ---------------------------------------------------------------------------------------------------- optimizer


class SOAP(BandOptimizer):
    """SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024), per band of
    ``max_preconditioner_dim`` rows, for plain tensors, ``ragged_optim.fully_shard`` params and torch ``DTensor``
    params (FSDP2's ``Shard(0)``, FSDP2 + TP, HSDP + TP: docs/parallelism.md). See the module docstring and
    docs/soap.md.

    Args:
        params: tensors or param groups (any key below may be set per group).
        lr: learning rate.
        betas: ``(b1, b2)``: Adam's moment factors (``0 <= b < 1``).
        shampoo_beta: EMA factor of the Kronecker factors ``L``, ``R`` (in ``[0, 1)``); None means ``betas[1]``.
        eps: added to ``sqrt(V')``.
        weight_decay: decoupled, applied after the update: ``p *= 1 - lr * weight_decay``.
        precondition_frequency: the eigenbases are refreshed (one QR power step) every this many Adam steps.
        max_preconditioner_dim: B. The ``[d0, prod(rest)]`` view of a param is cut into bands of B rows, each a
            block with its own left factor (``r x r``, ``r <= B``) and, when ``prod(rest) <= B``, right factor
            (else its columns are not rotated); each band is one layout block of the sharding layer.
        normalize_grads: divide each band's direction by its root mean square (1-D params: the param's).
        correct_bias: Adam's bias correction, folded into the step size as the reference does.

    State per param: ``step`` (calls with a grad, the first one included: Adam's t is ``step - 1``); for matrices
    ``bands``: for each band computed on this rank, ``L``, ``Q_L``, (``R``, ``Q_R``), ``exp_avg`` (``r x c``,
    original space), ``exp_avg_sq`` (rotated space); for 1-D and 0-D params ``exp_avg`` and ``exp_avg_sq`` of the
    local elements. Params whose grad is None are skipped.
    """

    epsilon_key = "eps"
    epsilon_purpose = "it keeps M / (sqrt(V) + eps) finite"
    vector_elementwise_keys = ("exp_avg", "exp_avg_sq")
    grads_travel_in_state_dtype = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_preconditioner_dim: int = 10000,
        normalize_grads: bool = False,
        correct_bias: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            shampoo_beta=shampoo_beta,
            eps=eps,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_preconditioner_dim=max_preconditioner_dim,
            normalize_grads=normalize_grads,
            correct_bias=correct_bias,
        )
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ checks

    def _check_betas(self, g: dict[str, Any]) -> None:
        b1, b2 = g["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must satisfy 0 <= beta1 < 1 and 0 <= beta2 < 1, got {g['betas']}")
        if g["shampoo_beta"] is not None:
            sb = check_real("shampoo_beta", g["shampoo_beta"])
            if not 0.0 <= sb < 1.0:
                raise ValueError(
                    f"shampoo_beta must be in [0, 1) (or None for betas[1]), got {g['shampoo_beta']}; the reference "
                    "implementation's -1 for 'use betas[1]' is None here"
                )

    def _check_own_keys(self, g: dict[str, Any]) -> None:
        for k in ("normalize_grads", "correct_bias"):
            check_bool(k, g[k])

    def _check_state_dict(self, state_dict: Any) -> None:
        """Also: every saved band has the tensors and shapes of this param's band under the saved
        ``max_preconditioner_dim`` (a band of another layout would fail deep inside ``step``, or silently mix)."""
        super()._check_state_dict(state_dict)
        saved = state_dict["param_groups"]
        ids = [(g, i) for g in saved for i in g["params"]]
        ours = [(gi, i, p) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])]
        for (g, key), (gi, i, p) in zip(ids, ours):
            bands = (state_dict["state"].get(key) or {}).get("bands")
            if bands is None:
                continue
            B = g["max_preconditioner_dim"]
            where = f"SOAP.load_state_dict: the saved state of {self._param_label(gi, i)}"
            if len(full_shape(p)) < 2 or not isinstance(bands, dict):
                raise ValueError(f"{where} has bands, but the param is not a matrix: saved for another model?")
            d0, cols, rows = band_geometry(full_shape(p), B)
            for k, band in bands.items():
                if not (isinstance(k, int) and 0 <= k * rows < d0):
                    raise ValueError(f"{where} has band {k!r}, but the param has {-(-d0 // rows)} bands of {rows} rows")
                want = _band_shapes(min(rows, d0 - k * rows), cols, B)
                for name in sorted(set(want) | set(band) - {"step"}):  # (a band's step: kept since 2026-12)
                    got = tuple(band[name].shape) if isinstance(band.get(name), Tensor) else band.get(name)
                    if got != want.get(name):
                        raise ValueError(
                            f"{where}: band {k} entry {name!r} has shape {got}, expected {want.get(name)} with "
                            f"max_preconditioner_dim={B}: saved with another max_preconditioner_dim or for another "
                            "param?"
                        )

    # ------------------------------------------------------------------ band state

    def _state_dtype(self, p: Tensor) -> torch.dtype:
        return compute_dtype(local(p).dtype)  # statistics, bases and moments: float32 (float64 for float64 params)

    def _preconditioner_tensors(self, band: dict) -> Iterable[Tensor]:
        """Every entry of the band: factors, bases and moments (and its step)."""
        return band.values()

    def _band_state_elements(self, rows: int, cols: int, numel: int, group: dict) -> int:
        """``L``, ``Q_L``, ``R``, ``Q_R`` when the columns are rotated, the two moments. It grows with the per-step
        work (rotations and factor products, ``numel * (rows + cols)``) too."""
        return sum(a * b for a, b in _band_shapes(rows, cols, group["max_preconditioner_dim"]).values())

    def _band_step(self, g: Tensor, bands: dict, k: int, step: int, group: dict, label: str) -> Tensor:
        """A band's state is created from its first gradient (direction 0), else one SOAP step at Adam's t."""
        if k not in bands:
            bands[k] = new_band_state(g, group["max_preconditioner_dim"], shampoo_beta_of(group))
            return torch.zeros_like(g)
        return soap_band_step(g, bands[k], step - 1, group, label)

    # ------------------------------------------------------------------ elementwise

    def _vector_direction(self, p: Tensor, grad: Tensor, state: dict, group: dict) -> Tensor | None:
        g = grad.to(compute_dtype(p.dtype))
        if "exp_avg" not in state:  # the first step: moments start at zero, the gradient is not used
            state["exp_avg"] = torch.zeros_like(g)
            state["exp_avg_sq"] = torch.zeros_like(g)
            return None
        n = adam_direction(g, state, group)
        if group["normalize_grads"]:  # the param's root mean square, over all of its shards
            sq = all_reduce_over_shards(n.square().sum().reshape(1), p)
            n = n / (1e-30 + (sq / math.prod(full_shape(p))).sqrt())
        return n

    def _apply(self, p: Tensor, n: Tensor | None, group: dict) -> None:
        """The lr step with bias correction, then decoupled weight decay (nothing at a param's first step)."""
        t = int(self.state[p]["step"].item()) - 1
        if n is None or t == 0:
            return
        lp = local(p)
        lr = self._group_lr(group)
        lp.add_(n.reshape(lp.shape).to(lp.dtype), alpha=-step_size(group, t, lr))
        if group["weight_decay"] > 0:
            lp.mul_(1 - lr * group["weight_decay"])
