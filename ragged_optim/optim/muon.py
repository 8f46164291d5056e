"""Muon for hidden-layer matrices, AdamW for everything else, in one ``torch.optim.Optimizer``.

The algorithm is the pure functions at the top, one Muon step of one matrix in :func:`muon_update` (read it against
torch.optim.Muon's ``_single_tensor_muon`` or Keller Jordan's ``muon_update``): momentum and the Nesterov blend
(:func:`muon_momentum_`), Newton-Schulz on the update's matrix view (:func:`muon_orthogonalize`), the shape-adjusted
lr (:func:`adjust_lr`) and decoupled weight decay (:func:`muon_apply_`). AdamW params take torch.optim.AdamW's
elementwise step (:mod:`ragged_optim.optim.adamw`), so they work on shards unchanged.

:class:`Muon` holds the distribution plumbing: which of those functions runs where and when, on whatever tensor a
param is (whole, or one rank's shard). Each Muon param takes one of two paths:

- **held whole here** (a plain tensor, or a sharded param this rank holds whole): the three functions in a row, one
  param at a time, as torch does; on a CPU small same-shape matrices share one batched Newton-Schulz
  (:mod:`ragged_optim.optim.muon_batches`) where that gives each matrix its own result exactly.
- **cut** (a rank boundary cuts one of its matrices; or held in part): Newton-Schulz through the block API
  (:meth:`Muon._orthogonalize_updates`, :meth:`~ragged_optim.optim.blocks.BlockOptimizer.map_blocks`), which
  gathers each cut matrix whole to its owner rank and scatters the result back.

The momentum runs per param on a CPU (right before that param's Newton-Schulz, while its tensors are in cache) and
as one foreach op per group on a GPU; the decay comes right before the param's update, or with the momentum as one
foreach op. Every arrangement gives the same bits: the Muon params match ``torch.optim.Muon`` (with
``ns_matmul="native"`` bitwise on CPU in our tests), the AdamW params ``torch.optim.AdamW`` (bitwise).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ragged_optim.kernels.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_EPS,
    DEFAULT_NS_STEPS,
    NS_MATMUL_MODES,
    batched_is_exact,
    newton_schulz,
)
from ragged_optim.optim.adamw import adamw_group_update_, foreach_rounds_scalars
from ragged_optim.optim.base import full_shape, is_dtensor, local, on_foreach_device
from ragged_optim.optim.blocks import check_wire_dtype
from ragged_optim.optim.muon_batches import SmallMatrixBatch, SmallMatrixBatches
from ragged_optim.optim.muon_groups import (  # (the two key lists: routing.py reads them from here)
    ADAMW_GROUP_KEYS,
    ADJUST_LR_MODES,
    MUON_GROUP_KEYS,
    make_group,
    split_by_shape,
    unused_keys,
    validate_group,
)
from ragged_optim.optim.optimizer import RaggedOptimizer, check_eps_in_dtype
from ragged_optim.sharding import BlockSpec, shard_info
from ragged_optim.sharding.owner_balance import newton_schulz_cost
from ragged_optim.sharding.state_schema import Elem, Replicated

__all__ = [
    "BF16_NS_REL_TOL",
    "Muon",
    "MuonItem",
    "NewtonSchulzSettings",
    "adjust_lr",
    "matrix_shape",
    "muon_apply_",
    "muon_momentum_",
    "muon_orthogonalize",
    "muon_update",
]

#: The size of bf16 Newton-Schulz rounding noise, relative: ``max|O_bf16 - O_fp32| / max|O_fp32|`` for one
#: orthogonalized update, and ``max|p_a - p_b| / max|p_b - p_0|`` for params after k Muon steps. A figure measured on
#: one CPU (torch 2.13, between ns_dtype=bfloat16 and float32: 1.6e-2 .. 3.2e-2 for a single update over square, tall,
#: wide, 1 x N and N x 1 matrices, 0.8e-2 .. 1.2e-2 for params after 10 steps; tests/optim/muon/test_muon_one_process.py
#: prints both), for a user's rough expectations. Another CPU's GEMM rounds differently, so the tests do not use it as a
#: bound: they bound a bf16 gap by the distance torch's own bf16 Newton-Schulz has from a float64 one, measured in the
#: same run (tests/support/ns_reference.py).
BF16_NS_REL_TOL = 5e-2

# ---------------------------------------------------------------------- the algorithm, one matrix at a time


@dataclass(frozen=True)
class NewtonSchulzSettings:
    """A Muon group's Newton-Schulz iteration, read from its plain keys (``ns_steps``, ``ns_coefficients``, ``eps``,
    ``ns_dtype``: the group keeps those, so LR schedulers and state dicts see plain values). Hashable: matrices with
    equal settings may share a batch."""

    steps: int
    coefficients: tuple[float, ...]
    eps: float
    dtype: torch.dtype

    @classmethod
    def of(cls, group: dict[str, Any]) -> NewtonSchulzSettings:
        return cls(group["ns_steps"], tuple(group["ns_coefficients"]), group["eps"], group["ns_dtype"])

    def kwargs(self) -> dict[str, Any]:
        """The settings as :func:`newton_schulz`'s keyword arguments."""
        return dict(steps=self.steps, coefficients=self.coefficients, eps=self.eps, dtype=self.dtype)


def adjust_lr(lr: float, mode: str | None, matrix_shape: tuple[int, int]) -> float:
    """Muon's shape-dependent learning rate, written exactly as ``torch.optim.Muon`` computes it.

    ``"original"`` (Keller Jordan): ``lr * sqrt(max(1, m / n))``; ``"match_rms_adamw"`` (Moonshot):
    ``lr * 0.2 * sqrt(max(m, n))``, which lets Muon reuse an AdamW-tuned lr and weight decay.
    """
    m, n = matrix_shape
    if mode is None or mode == "original":
        ratio = math.sqrt(max(1, m / n))
    elif mode == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(m, n))
    else:
        raise ValueError(f"adjust_lr must be one of {ADJUST_LR_MODES}, got {mode!r}")
    return lr * ratio


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The (m, n) of the matrix (or of each matrix of a stack) a param of ``shape`` is: 2-D as is, 3-D ``[E, R, C]``
    as E matrices ``R x C``, 4-D and up (conv) flattened to ``[shape[0], prod(rest)]``."""
    if len(shape) == 2 or len(shape) == 3:
        return int(shape[-2]), int(shape[-1])
    if len(shape) >= 4:
        return int(shape[0]), int(math.prod(shape[1:]))
    raise ValueError(f"a {len(shape)}-D tensor of shape {tuple(shape)} has no matrix shape")


def muon_momentum_(momentum_buffer: Tensor, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Momentum in place (``buf.lerp_(grad, 1 - momentum)``), then the update to orthogonalize: the Nesterov blend
    ``grad.lerp(buf, momentum)``, or the buffer itself. Elementwise: works on a shard."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def muon_orthogonalize(update: Tensor, shape: Sequence[int], ns: NewtonSchulzSettings, matmul: str) -> Tensor:
    """Newton-Schulz on the whole (contiguous) ``update`` of a param of ``shape``, viewed as its matrix or stack of
    matrices (:func:`matrix_shape`'s view); the result is in ``ns.dtype``, shaped like that view."""
    want = tuple(shape) if len(shape) <= 3 else (shape[0], update.numel() // shape[0])
    matrices = update if tuple(update.shape) == want else update.view(want)
    return newton_schulz(matrices, **ns.kwargs(), matmul=matmul, out_dtype=ns.dtype)


def muon_apply_(param: Tensor, ortho: Tensor, *, lr: float, decay: float) -> None:
    """Decoupled weight decay ``p *= decay``, then ``p -= lr * ortho`` (torch.optim.Muon's order). ``lr``: the
    shape-adjusted lr (:func:`adjust_lr`); ``decay``: ``1 - lr * weight_decay`` with the group's lr as it is (1:
    none). ``param`` is a plain tensor holding the matrices of ``ortho``."""
    if decay != 1:
        param.mul_(decay)
    # (an op on an nn.Parameter costs the host a __torch_function__ round: no view unless the shape differs)
    (param if param.shape == ortho.shape else param.view(ortho.shape)).add_(ortho, alpha=-lr)


def muon_update(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    adjust_lr_mode: str | None,
    ns: NewtonSchulzSettings,
    matmul: str = "native",
) -> None:
    """One Muon step of one param held whole, in place on ``param`` and ``momentum_buffer``: the algorithm.

    :class:`Muon` runs these same functions, split where distribution or batching needs it (the momentum of a
    group as one foreach op, Newton-Schulz of a cut matrix on its owner rank): the same bits."""
    update = muon_momentum_(momentum_buffer, grad, momentum, nesterov)
    ortho = muon_orthogonalize(update, param.shape, ns, matmul)
    muon_apply_(param, ortho, lr=adjust_lr(lr, adjust_lr_mode, matrix_shape(param.shape)), decay=1 - lr * weight_decay)


# ---------------------------------------------------------------------- the optimizer: where each piece runs


def _decay_(p: Tensor, factor: float) -> None:
    """Decoupled weight decay ``p *= factor`` on this rank's elements of ``p`` (nothing when the factor is 1)."""
    if factor != 1:
        local(p).mul_(factor)


class MuonItem(NamedTuple):
    """One Muon param's update on its way from its momentum to its Newton-Schulz and update."""

    param: Tensor  # the param tensor as the optimizer holds it (whole, or a shard)
    update: Tensor  # the momentum/Nesterov update, same shape as ``param``
    group: dict  # the param group (ns_steps, ns_coefficients, eps, ns_dtype, lr, adjust_lr)


class Muon(RaggedOptimizer):
    """Muon (MomentUm Orthogonalized by Newton-Schulz) for matrices, AdamW for the rest.

    Args:
        params: tensors or param groups. A group may carry ``use_muon`` (bool). Groups without it are split by
            shape: params with ``ndim >= 2`` get Muon, the rest AdamW. Shape alone cannot tell an embedding table
            or the output head (2-D, but they belong with AdamW) from a hidden matrix: build the groups with
            :func:`ragged_optim.optim.muon_param_groups` for a model, or set ``use_muon`` yourself.
        lr, momentum, nesterov, weight_decay: Muon hyperparameters (``torch.optim.Muon``'s meaning; weight decay
            is decoupled: ``p *= 1 - lr * weight_decay``).
        ns_steps, ns_coefficients, eps: the Newton-Schulz iteration (see :func:`ragged_optim.kernels.newton_schulz`).
        adjust_lr: ``"original"`` (``sqrt(max(1, m/n))``) or ``"match_rms_adamw"`` (``0.2 * sqrt(max(m, n))``),
            torch's ``adjust_lr_fn``; ``None`` means ``"original"``.
        ns_dtype: Newton-Schulz compute dtype, ``torch.bfloat16`` (torch.optim.Muon's) or ``torch.float32``.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: defaults for AdamW params.
        wire_dtype: how sharded momentum travels to a matrix's owner and the orthogonalized update back. None
            (default): ``ns_dtype``, which changes no bit of the result (Newton-Schulz starts by casting to it);
            a dtype (e.g. ``torch.bfloat16`` with fp32 NS); ``"int8"`` or ``"fp8_e4m3"``: block-quantized, one
            fp32 scale per 128 elements (about a quarter of fp32's bytes; approximate).
        ns_matmul: how Newton-Schulz runs its matmuls. ``"native"``: in ``ns_dtype``, torch.optim.Muon's ops, bit
            for bit. ``"upcast"``: operands and results rounded to ``ns_dtype``, each matmul in float32 (bf16 storage,
            fp32 accumulation, as a bf16 GEMM does on GPUs). ``"auto"`` (default): ``"upcast"`` for bf16/fp16 on a
            CPU without a native low-precision GEMM (there it is 10-70x faster per matmul and as accurate),
            ``"native"`` elsewhere. See :mod:`ragged_optim.kernels.newton_schulz`.
        foreach: how a group's elementwise ops run. None (default): the AdamW params' as ``torch._foreach_*`` ops
            (one op for all params instead of ~9 per param); the Muon params' momentum and weight decay as foreach
            ops on a GPU (a small model's step is bound by the host's cost per op there), per param on a CPU: the
            momentum right before that param's Newton-Schulz, the decay right before its update (its tensors are
            still in cache; torch.optim.Muon's order). True / False: foreach / per param for both. The same bits
            every way.

    Group keys. In a group with ``use_muon=False`` the keys ``lr``, ``betas``, ``eps``, ``weight_decay`` are the
    AdamW values (falling back to the group's ``adamw_*`` keys, then to the constructor's ``adamw_*``). In a group
    without ``use_muon`` (split by shape), plain keys belong to the Muon half and the AdamW half reads only the
    group's ``adamw_*`` keys. Every stored group has ``use_muon`` set, so LR schedulers, ``state_dict`` and
    ``load_state_dict`` work as usual (a split group is two entries in ``param_groups``).

    Matrix view of a Muon param: 2-D as is; 3-D ``[E, R, C]`` is a stack of E matrices ``R x C`` each orthogonalized
    alone (fused experts; a Conv1d weight ``[out, in, k]`` is 3-D too: give it ``use_muon=False`` or reshape it);
    4-D and up (conv) flattened to ``[shape[0], prod(rest)]``. The lr adjustment uses that matrix shape.

    State: ``momentum_buffer`` for Muon params; ``step``, ``exp_avg``, ``exp_avg_sq`` for AdamW params (torch's
    names). Params whose ``grad`` is None are skipped.
    """

    #: Passed to :func:`newton_schulz` as ``batched_matmul``. False: one matrix at a time, every result bitwise what
    #: orthogonalizing it alone gives (and torch.optim.Muon's), one update alive at a time (except for params whose
    #: matrices a rank boundary cuts, which are exchanged together). True: same-shape matrices share a ``baddbmm``
    #: batch, which may round otherwise and keeps every Muon param's update alive until the batch is done. None (the
    #: default): False, except that whole small matrices on a CPU share batches of up to 8 where that is faster and
    #: exactly the per-matrix result (:func:`~ragged_optim.kernels.newton_schulz.batched_is_exact`): the same bits.
    ns_batched_matmul: bool | None = None
    #: The most bytes of cut blocks (the matrices a rank boundary cuts, in the update's dtype) that one exchange
    #: gathers to any one owner rank, orthogonalizes and scatters back. The params with cut blocks go through
    #: exchanges that stay under it on every owner (a param over it goes alone), so the updates, gathered blocks
    #: and results alive at once during a step are bounded whatever the model's size; two all_to_alls per exchange.
    #: Counted from the routes, which every rank knows alike: every rank cuts a step into the same exchanges.
    #: ``"auto"`` (default): half the unsharded bytes of the largest ``fully_shard`` unit holding a cut param, at
    #: least 2 MiB (what the step may hold without passing the backward's peak, which holds a unit's params and
    #: grads: on bench20m 2 MiB and half a unit kept the step under the backward, 8 MiB did not; the floor keeps a
    #: small model's step one exchange), 8 MiB for params of no such unit (FSDP2 DTensors). None: one exchange for
    #: all of a step's cut params (all alive at once). Not applied with ``ns_batched_matmul=True``, which asks every
    #: update to wait for its batch.
    exchange_max_bytes: int | str | None = "auto"

    # How a subclass reshapes the step. Each flag may be set in a subclass's body; where it is not,
    # __init_subclass__ derives it from the methods the subclass defines, so that an override is always called.
    #: True: every Muon param's momentum (and decay) goes through :meth:`_local_muon_update`, one param at a time,
    #: never the group's foreach ops. Default for a subclass that defines ``_local_muon_update``.
    per_param_momentum: bool = False
    #: False: every Muon param goes through :meth:`_orthogonalize_updates` and :meth:`_apply_muon_update` (the cut
    #: path), none straight to Newton-Schulz as a matrix held whole. Default for a subclass that defines one of
    #: :data:`_CUT_PATH_METHODS`.
    whole_matrix_path: bool = True
    #: False: every param held whole goes through :meth:`_finish_whole_param`, none into a small-matrix batch.
    #: Default for a subclass that defines ``_finish_whole_param``.
    batch_small_matrices: bool = True
    _CUT_PATH_METHODS = ("_orthogonalize_updates", "_orthogonalize_blocks", "_apply_muon_update")

    _settings_attrs = (
        *RaggedOptimizer._settings_attrs,
        "wire_dtype",
        "ns_matmul",
        "foreach",
        "ns_batched_matmul",
        "exchange_max_bytes",
        "per_param_momentum",
        "whole_matrix_path",
        "batch_small_matrices",
        "_split_by_shape",
    )

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = DEFAULT_NS_STEPS,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_NS_EPS,
        adjust_lr: str | None = "original",
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-10,
        adamw_weight_decay: float = 0.0,
        wire_dtype: torch.dtype | str | None = None,
        ns_matmul: str = "auto",
        foreach: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            eps=eps,
            adjust_lr=adjust_lr,
            ns_dtype=ns_dtype,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
        )
        # Check every constructor value now, the AdamW ones too (no group may use them yet).
        self._validate_group(dict(defaults, use_muon=True))
        self._validate_group({"use_muon": False, **{k: defaults[f"adamw_{k}"] for k in ADAMW_GROUP_KEYS}})
        check_wire_dtype(wire_dtype, "Muon")
        if ns_matmul not in NS_MATMUL_MODES:
            raise ValueError(f"ns_matmul must be one of {NS_MATMUL_MODES}, got {ns_matmul!r}")
        if foreach not in (None, True, False):
            raise ValueError(f"foreach must be None, True or False, got {foreach!r}")
        self.wire_dtype = wire_dtype
        self.ns_matmul = ns_matmul
        self.foreach = foreach
        self._split_by_shape = False  # set when a group without ``use_muon`` was split by ndim
        super().__init__(params, defaults)
        if self._split_by_shape and not any(g["params"] for g in self.param_groups if g["use_muon"]):
            n = sum(len(g["params"]) for g in self.param_groups)
            warnings.warn(
                f"Muon got no matrix params: all {n} params have fewer than 2 dims (or no elements) and take its "
                "AdamW path. Pass the model's hidden weight matrices (ragged_optim.muon_param_groups(model) routes "
                "a whole model), or use torch.optim.AdamW for these params.",
                UserWarning,
                stacklevel=2,
            )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the subclass's own body and the mixins listed before its Muon base
        own = [cls, *(k for k in cls.__mro__[1 : cls.__mro__.index(Muon)] if not issubclass(k, Muon))]
        defines = lambda *names: any(name in vars(k) for k in own for name in names)
        derived = {
            "per_param_momentum": (defines("_local_muon_update"), True),
            "whole_matrix_path": (defines(*Muon._CUT_PATH_METHODS), False),
            "batch_small_matrices": (defines("_finish_whole_param"), False),
        }
        for flag, (overridden, value) in derived.items():
            if overridden and not any(flag in vars(k) for k in own):
                setattr(cls, flag, value)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; a group without ``use_muon`` is split by ``ndim`` into a Muon and an AdamW group (an empty
        matrix goes to the AdamW one). A group refused (either half) leaves the optimizer as it was."""
        self._auto_exchange = None  # (exchange_max_bytes="auto" looks at the params again)
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        entries = param_group["params"]
        if isinstance(entries, Tensor):
            entries = [entries]
        elif isinstance(entries, set):
            raise TypeError("Muon params must be an ordered collection (a list), not a set")
        else:
            entries = list(entries)
        use_muon = param_group.get("use_muon")
        if use_muon is not None and not isinstance(use_muon, bool):  # bool("false") is True
            raise TypeError(f"use_muon must be True, False or None (split by shape), got {use_muon!r}")
        if use_muon is None:
            n_groups, split_before = len(self.param_groups), self._split_by_shape
            try:
                self._add_split_group(param_group, entries)
            except Exception:
                del self.param_groups[n_groups:]
                self._split_by_shape = split_before
                raise
        else:
            self._add_group(param_group, entries, use_muon=use_muon, split=False)

    def _add_split_group(self, param_group: dict[str, Any], entries: list) -> None:
        self._split_by_shape = True
        matrices, others = split_by_shape(entries)
        if matrices:
            self._add_group(param_group, matrices, use_muon=True, split=True)
        if others or not matrices:
            self._add_group(param_group, others, use_muon=False, split=True)

    def _add_group(self, user: dict[str, Any], entries: list, *, use_muon: bool, split: bool) -> None:
        group = make_group(user, entries, self.defaults, use_muon=use_muon, split=split)
        self._validate_group(group)
        super().add_param_group(group)
        group = self.param_groups[-1]
        # Optimizer.add_param_group filled in every default; keep only the keys this kind of group uses.
        for k in unused_keys(use_muon):
            group.pop(k, None)
        try:
            self._check_params(len(self.param_groups) - 1, group, explicit=not split)
        except ValueError:
            self.param_groups.pop()
            raise

    @staticmethod
    def _validate_group(g: dict[str, Any]) -> None:
        """Check a group's values (types, then ranges); normalize in place: tuples, ``adjust_lr=None``."""
        validate_group(g)

    def _group_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("use_muon", *(MUON_GROUP_KEYS if group.get("use_muon") else ADAMW_GROUP_KEYS))

    def _state_keys(self, group: dict[str, Any], p: Tensor) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["use_muon"] else ("step", "exp_avg", "exp_avg_sq")

    def state_schema(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Muon's momentum, AdamW's moments: one value per element; AdamW's step counter: replicated."""
        if group["use_muon"]:
            return {"momentum_buffer": Elem()}
        return {"step": Replicated(), "exp_avg": Elem(), "exp_avg_sq": Elem()}

    def _check_params(self, gi: int, group: dict[str, Any], *, explicit: bool) -> None:
        for i, p in enumerate(group["params"]):
            if is_dtensor(p) and shard_info(p) is None:  # (else a torch error about mesh dims at the first step)
                self._check_dtensor(gi, i, p)
            if p.is_complex():
                raise ValueError(
                    f"{self._param_label(gi, i)} is complex ({p.dtype}); Muon and its AdamW path support real "
                    "params only: optimize complex params with torch.optim.AdamW, or view them as real "
                    "(torch.view_as_real) in the model."
                )
            if group["use_muon"] and 0 in full_shape(p):
                raise ValueError(
                    f"{self._param_label(gi, i)} has no elements; Muon cannot orthogonalize an empty matrix. "
                    "Leave it out of the optimizer (it has nothing to learn) or give it use_muon=False"
                )
            if not group["use_muon"]:
                check_eps_in_dtype(self._param_label(gi, i), p, group["eps"], "adamw_eps")
            ndim = len(full_shape(p))
            if group["use_muon"] and ndim < 2:
                how = "use_muon=True was requested for it" if explicit else "it was routed to Muon"
                raise ValueError(
                    f"{self._param_label(gi, i)} is {ndim}-D but {how}; Muon orthogonalizes matrices. Put 1-D "
                    "params (biases, norm gains, scalars) in a group with use_muon=False (AdamW), or build the "
                    "groups with ragged_optim.optim.muon_param_groups(model)."
                )

    # ------------------------------------------------------------------ per-param hooks

    def _matrix_shape(self, p: Tensor) -> tuple[int, int]:
        """The (m, n) of the matrix (or of each matrix of a stack) that ``p`` is; used for the lr adjustment.

        Sharded params (ragged or DTensor) report their full (unsharded) matrix shape.
        """
        return matrix_shape(full_shape(p))

    def _momentum_buffer(self, key: Tensor, grad: Tensor) -> Tensor:
        """The momentum buffer kept under ``key`` (created as zeros like ``grad`` at its first step)."""
        state = self.state[key]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _local_muon_update(self, p: Tensor, grad: Tensor, group: dict[str, Any], key: Tensor | None = None) -> Tensor:
        """Weight decay, momentum and Nesterov, elementwise on ``p`` (whole or a shard); state is kept under ``key``
        (the param object the user gave, when ``p`` is its local shard). :meth:`step` calls it per param when
        :attr:`per_param_momentum` is set."""
        _decay_(p, 1 - self._group_lr(group) * group["weight_decay"])
        return self._momentum_update(p, grad, group, key)

    def _momentum_update(self, p: Tensor, grad: Tensor, group: dict[str, Any], key: Tensor | None = None) -> Tensor:
        """:func:`muon_momentum_` with ``p``'s buffer (the decay reads and writes ``p`` alone, so it may come at any
        time before the update with the same bits)."""
        buf = self._momentum_buffer(p if key is None else key, grad)
        return muon_momentum_(buf, grad, group["momentum"], group["nesterov"])

    def block_spec(self, p: Tensor, group: dict[str, Any]) -> BlockSpec | None:
        """Muon params compute on whole matrices (each matrix of a stack), computed by one owner rank."""
        return BlockSpec.matrices(full_shape(p)) if group["use_muon"] else None

    def block_cost(self, p: Tensor, spec: BlockSpec, numel: int) -> float:
        return newton_schulz_cost(*self._matrix_shape(p))

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One optimizer step; ``closure`` (optional) re-evaluates the model and returns the loss."""
        loss, skip = self._begin_step(closure)
        if skip:
            return loss
        items: list[MuonItem] = []
        self._exchange_numel: dict = {}  # per owner: the elements of the cut blocks waiting in ``items``
        small = SmallMatrixBatches(self._finish_small_matrices, self.ns_matmul)
        groups = []  # every grad is checked before anything changes
        for gi, group in enumerate(self.param_groups):
            params, grads = [], []
            for i, p in enumerate(group["params"]):
                grad = self._grad_of(gi, i, p)
                if grad is not None:
                    params.append(p)
                    grads.append(local(grad))
            if params:  # (foreach ops refuse empty lists)
                groups.append((group, params, grads))
        if self.whole_matrix_path and self.batch_small_matrices and self.ns_batched_matmul is None:
            for group, params, grads in groups:
                if group["use_muon"] and grads[0].device.type == "cpu":  # (a GPU's step: no bucket lookups)
                    small.plan(params, grads, NewtonSchulzSettings.of(group))
        try:
            for group, params, grads in groups:
                self._step_group(group, params, grads, items, small)
            small.finish_all()
        except BaseException:
            with contextlib.suppress(Exception):
                small.finish_all()  # params whose momentum moved get their update, as one at a time they would have
            raise
        if items:
            self._finish_muon_items(items)
        return loss

    def _step_group(self, group: dict, params: list[Tensor], grads: list[Tensor], items: list[MuonItem],
                    small: SmallMatrixBatches) -> None:  # fmt: skip
        """One group of :meth:`step`: AdamW params in full; each Muon param's momentum, then its path. Held whole
        here: finished now, or waiting in ``small`` for its batch. Cut: waiting in ``items`` for one exchange (all
        params with ``ns_batched_matmul``); held in part: through :meth:`map_blocks` now."""
        if not group["use_muon"]:
            if "momentum" in group:  # set by a scheduler that cycles momentum (OneCycleLR, CyclicLR): beta1
                group["betas"] = (group["momentum"], group["betas"][1])
            adamw_group_update_(params, grads, [self.state[p] for p in params], group, self.foreach is not False)
            return
        lr = self._group_lr(group)
        ns = NewtonSchulzSettings.of(group)
        updates, decay = self._momentum_updates(params, grads, group, lr)
        for p, update in zip(params, updates):
            item = MuonItem(p, update, group)
            if self.ns_batched_matmul or self.has_cut_blocks(p):  # cut: waits for its exchange
                self._make_room_for(item, items)
                _decay_(p, decay)
                items.append(item)
            elif not (self.whole_matrix_path and self._step_whole_param(item, ns, lr, decay, small)):
                # held in part here (or the whole path is off): its blocks, all on their holders, through
                # map_blocks now, so one update is alive at a time
                _decay_(p, decay)
                self._finish_muon_items([item])

    def _momentum_updates(self, params: list[Tensor], grads: list[Tensor], group: dict[str, Any], lr: float):
        """Each param's update (lazily, so that one is alive at a time), and the weight decay factor still to apply
        to each param before its update (1 when done with the momentum)."""
        if self.per_param_momentum:
            return (self._local_muon_update(local(p), g, group, key=p) for p, g in zip(params, grads)), 1.0
        if self.foreach or (self.foreach is None and on_foreach_device(grads)):
            return self._foreach_momentum_updates(params, grads, group, lr), 1.0
        # per param: the decay right before p's update, while p is in cache (as torch does)
        updates = (self._momentum_update(local(p), g, group, key=p) for p, g in zip(params, grads))
        return updates, 1 - lr * group["weight_decay"]

    def _foreach_momentum_updates(self, params: list[Tensor], grads: list[Tensor], group: dict[str, Any], lr: float):
        """:meth:`_local_muon_update` for all of a group's params: the in-place parts (momentum, weight decay) as one
        foreach op each (on a GPU a small model's step is bound by the host's cost per op), then, lazily, one
        Nesterov update per param (so that one is alive at a time). The same bits as per param."""
        bufs = [self._momentum_buffer(p, grad) for p, grad in zip(params, grads)]
        momentum = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        wd = group["weight_decay"]
        if wd != 0:
            ps = [local(p) for p in params]
            if any(foreach_rounds_scalars(p.device, p.dtype) for p in ps):
                for p in ps:
                    _decay_(p, 1 - lr * wd)
            else:
                torch._foreach_mul_(ps, 1 - lr * wd)
        for grad, buf in zip(grads, bufs):
            yield grad.lerp(buf, momentum) if group["nesterov"] else buf

    # ------------------------------------------------------------------ matrices held whole here

    def _step_whole_param(
        self, item: MuonItem, ns: NewtonSchulzSettings, lr: float, decay: float, small: SmallMatrixBatches
    ) -> bool:
        """The rest of a step for a param held whole here: into its small-matrix batch, or finished now. False when
        this rank holds part of it."""
        return small.add(item.param, item.update, item.group, ns, lr, decay) or self._finish_whole_param(
            item, ns, lr, decay
        )

    def _finish_whole_param(self, item: MuonItem, ns: NewtonSchulzSettings, lr: float, decay: float = 1.0) -> bool:
        """Newton-Schulz and the update for a param this rank holds whole (a plain tensor, or a sharded param held
        whole here) or not at all (nothing to do): :func:`muon_orthogonalize` straight on the update and
        :func:`muon_apply_` from its ``ns_dtype`` result, as torch.optim.Muon does (the same bits as through
        :meth:`map_blocks`, without its bookkeeping or the copy back into the update: on a GPU this step is
        launch-bound). False when this rank holds part of the param (its blocks go through :meth:`map_blocks`).
        ``lr``: the group's lr as a number; ``decay``: the weight decay factor still to apply to ``p`` (right
        before its update; 1: none)."""
        p_local, shape = local(item.param), full_shape(item.param)
        if p_local.numel() == 0:
            return True
        if p_local.numel() != math.prod(shape) or not (p_local.is_contiguous() and item.update.is_contiguous()):
            return False
        ortho = muon_orthogonalize(item.update, shape, ns, self.ns_matmul)
        self._add_whole_update(item.param, item.group, lr, decay, ortho)
        return True

    def _add_whole_update(self, param: Tensor, group: dict, lr: float, decay: float, ortho: Tensor) -> None:
        """:func:`muon_apply_` for a param held whole, from its ``ns_dtype`` result, with the lr adjusted for its
        (full) matrix shape."""
        lr = adjust_lr(lr, group["adjust_lr"], self._matrix_shape(param))
        muon_apply_(local(param), ortho, lr=lr, decay=decay)

    def _finish_small_matrices(self, batch: SmallMatrixBatch) -> None:
        """Newton-Schulz and the updates for same-shape whole matrices: one batched Newton-Schulz where that gives
        each matrix its own result exactly (probed), else one call per matrix: the same bits either way."""
        updates, ns_kw = batch.updates, batch.ns.kwargs()
        exact = len(updates) > 1 and batched_is_exact(
            *updates.shape, updates.dtype, updates.device, **ns_kw, matmul=self.ns_matmul
        )
        kw = dict(ns_kw, matmul=self.ns_matmul, out_dtype=batch.ns.dtype)
        if exact:
            orthos = newton_schulz(updates, batched_matmul=True, **kw).unbind(0)
        else:
            orthos = (newton_schulz(u, **kw) for u in updates)
        for x, ortho in zip(batch.pending, orthos):
            self._add_whole_update(x.param, x.group, x.lr, x.decay, ortho)

    # ------------------------------------------------------------------ cut matrices, through map_blocks

    def _make_room_for(self, item: MuonItem, items: list[MuonItem]) -> None:
        """Finish the cut params waiting in ``items`` (one exchange) when ``item``'s blocks would take some owner past
        :attr:`exchange_max_bytes`. Each matrix is orthogonalized alone either way: the same bits."""
        limit = self.exchange_max_bytes
        if limit is None or self.ns_batched_matmul:
            return
        if limit == "auto":
            limit = self._auto_exchange_bytes()
        size = item.update.element_size()
        new = self.routed_numel_by_owner(item.param)
        if items and any((self._exchange_numel.get(k, 0) + n) * size > limit for k, n in new.items()):
            self._finish_muon_items(items)
            items.clear()
            self._exchange_numel = {}
        for k, n in new.items():
            self._exchange_numel[k] = self._exchange_numel.get(k, 0) + n

    def _auto_exchange_bytes(self) -> int:
        """``exchange_max_bytes="auto"``: half the largest unit (unsharded bytes) that holds a cut param of this
        optimizer, at least 2 MiB (a small model's step stays one exchange), 8 MiB when no unit holds one; the same
        on every rank (units and routes are)."""
        cached = getattr(self, "_auto_exchange", None)
        if cached is None:
            units = {}
            for g in self.param_groups:
                for p in g["params"]:
                    info = shard_info(p)
                    if info is not None and g.get("use_muon") and self.has_cut_blocks(p):
                        units[id(info.unit)] = info.unit.layout.total_size * info.unit.local_shard.element_size()
            cached = self._auto_exchange = max(max(units.values()) // 2, 2 << 20) if units else 8 << 20
        return cached

    def _finish_muon_items(self, items: list[MuonItem]) -> None:
        """Newton-Schulz and the update for ``items``: the params whose matrices a rank boundary cuts go through
        here together (one exchange each way per process group); each param held in part alone, right after its
        momentum, unless ``ns_batched_matmul`` asks for same-shape matrices of different params to share a batch."""
        for item, ortho in zip(items, self._orthogonalize_updates(items)):
            self._apply_muon_update(item, ortho)

    def _orthogonalize_updates(self, items: list[MuonItem]) -> list[Tensor]:
        """Newton-Schulz on every update's matrices, through the block API (:meth:`map_blocks`): a
        matrix this rank holds whole is orthogonalized in place of its update's view; a sharded matrix is gathered
        whole to its owner (the planner's balanced owner for ragged params, a balanced choice for DTensors) in one
        all_to_all per process group, orthogonalized there exactly as on one process, and scattered back in one
        more. Returns one tensor per item, shaped like its local update: the update tensor itself, overwritten (a
        copy of it where it is the momentum buffer, without Nesterov), so that only one matrix's Newton-Schulz
        temporaries are alive at a time and no result is kept per matrix."""
        group_of = {id(it.param): it.group for it in items}
        updates = [it.update if it.group["nesterov"] else it.update.clone() for it in items]
        return self.map_blocks(
            lambda blocks: self._orthogonalize_blocks(blocks, group_of),
            [it.param for it in items],
            updates,
            out=updates,
            wire_dtype=self._wire_dtype([it.group for it in items]),
        )

    def _orthogonalize_blocks(self, blocks: list, group_of: dict[int, dict]) -> list[Tensor]:
        """Newton-Schulz on each block's matrix, written over the block (a view of the update, or the gathered
        copy); with ``ns_batched_matmul`` one ``newton_schulz`` call per (shape, device, dtype, NS settings)
        bucket, else one per matrix (the same bits: Newton-Schulz is computed one matrix at a time either way)."""
        buckets: dict[tuple, list[int]] = {}
        for i, b in enumerate(blocks):
            x, ns = b.value, NewtonSchulzSettings.of(group_of[id(b.param)])
            key = (tuple(x.shape), x.device, x.dtype, ns) if self.ns_batched_matmul else (i, ns)
            buckets.setdefault(key, []).append(i)
        for key, idx in buckets.items():
            kw = dict(key[-1].kwargs(), batched_matmul=self.ns_batched_matmul, matmul=self.ns_matmul)
            if len(idx) == 1:
                blocks[idx[0]].value.copy_(newton_schulz(blocks[idx[0]].value, **kw))
            else:
                ortho = newton_schulz(torch.stack([blocks[i].value for i in idx]), **kw)
                for i, o in zip(idx, ortho.unbind(0)):
                    blocks[i].value.copy_(o)
        return [b.value for b in blocks]

    def _wire_dtype(self, groups: list[dict]) -> torch.dtype | str | None:
        """Newton-Schulz starts by casting to ns_dtype, so sending in ns_dtype changes no bit of the result."""
        if self.wire_dtype is not None:
            return self.wire_dtype
        dtypes = {g["ns_dtype"] for g in groups}
        return dtypes.pop() if len(dtypes) == 1 else None

    def _apply_muon_update(self, item: MuonItem, ortho: Tensor) -> None:
        """``p -= adjusted_lr * ortho`` (:func:`muon_apply_`; the decay is done) with the lr adjusted for the param's
        (full) matrix shape; ``ortho`` is shaped like the local update."""
        g = item.group
        lr = adjust_lr(self._group_lr(g), g["adjust_lr"], self._matrix_shape(item.param))
        muon_apply_(local(item.param), ortho, lr=lr, decay=1.0)
