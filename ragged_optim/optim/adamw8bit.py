"""AdamW with 8-bit moments: block-wise quantized state whose blocks are *layout* blocks.

Both moments of a param with at least ``min_8bit_size`` elements (its full size) are stored as one 8-bit code per
element and one fp32 scale per block of ``block_size`` consecutive elements of the flattened param. Each step runs
the kernels layer's fused update (:func:`ragged_optim.kernels.adamw8bit_step`): dequantize both moments, AdamW,
requantize, one pass per block. Smaller params keep fp32 ``exp_avg``/``exp_avg_sq`` and take torch.optim.AdamW's
exact arithmetic (:func:`ragged_optim.optim.muon.adamw_update_`).

The three kinds of params (see :mod:`ragged_optim.optim.base`):

- plain tensors: blocks tile the flattened param from element 0;
- ragged-sharded params (``ragged_optim.fully_shard``): the constructor asks each unit to re-plan with
  ``BlockSpec.elements(block_size, numel)`` and ``allow_split=False``, so every rank's range starts on a block
  boundary. Each rank quantizes its own blocks with no communication, and the state and params are bit-identical
  to the one-process run at any world size. The step checks the layout (a RuntimeError if a range is cut).
- torch FSDP2 ``DTensor`` params (``Shard(0)``): torch's row chunks are not planned around blocks. Blocks restart
  at each rank's first element (per-rank blocks), so the numerics depend on the world size unless every chunk
  start happens to be a multiple of ``block_size``; a ``UserWarning`` names such params once.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ragged_optim.kernels import (
    FORMATS,
    adamw8bit_constants,
    adamw8bit_step,
    code_dtype,
    dequantize_blockwise,
    num_blocks,
    quantize_blockwise,
)
from ragged_optim.kernels.adamw8bit_ref import ieee_sqrt_
from ragged_optim.optim.base import full_shape, is_dtensor, local, request_block_specs, scalar
from ragged_optim.optim.muon import adamw_update_
from ragged_optim.optim.optimizer import RaggedOptimizer
from ragged_optim.sharding import BlockSpec, shard_info

__all__ = ["AdamW8bit", "DEFAULT_QMAPS", "STATE_KEYS_8BIT"]

#: (first moment format, second moment format). Chosen by measured convergence: docs/adamw8bit.md.
DEFAULT_QMAPS = ("dynamic", "dynamic_unsigned")
#: State entries of an 8-bit param, besides ``step``.
STATE_KEYS_8BIT = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


class AdamW8bit(RaggedOptimizer):
    """AdamW (decoupled weight decay) with 8-bit block-wise quantized moments.

    Args:
        params: tensors or param groups (plain, ragged-sharded, or FSDP2 DTensor ``Shard(0)``).
        lr, betas, eps, weight_decay: AdamW's (``torch.optim.AdamW`` meaning; ``p *= 1 - lr * weight_decay``).
        block_size: elements per quantization block (one fp32 scale each, per moment).
        min_8bit_size: params with fewer elements (full, unsharded size) keep fp32 state and equal
            ``torch.optim.AdamW`` exactly.
        qmaps: ``(m format, v format)``, formats of :mod:`ragged_optim.kernels` (``"dynamic"``,
            ``"dynamic_unsigned"``, ``"int8"``, ``"fp8_e4m3"``). The default takes the fused kernel; other choices
            run the same arithmetic unfused (dequantize, update, quantize) and exist to compare maps.

    State of an 8-bit param: ``step`` (fp32 scalar tensor), ``exp_avg_codes`` / ``exp_avg_sq_codes`` (one code per
    local element: uint8, int8 for the ``"int8"`` format) and ``exp_avg_scales`` / ``exp_avg_sq_scales`` (fp32, one
    per local block). Other params: torch's ``step``, ``exp_avg``, ``exp_avg_sq``. ``state_dict`` holds this rank's
    state (same world size and layout to load it back).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block_size: int = 256,
        min_8bit_size: int = 4096,
        *,
        qmaps: tuple[str, str] = DEFAULT_QMAPS,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            block_size=block_size,
            min_8bit_size=min_8bit_size,
            qmaps=tuple(qmaps),
        )
        self._validate_group(defaults)
        self._warned: set[int] = set()
        super().__init__(params, defaults)
        # Ragged 8-bit params: re-plan their units so no rank boundary cuts a block (a collective on each unit).
        request_block_specs(
            [
                (p, BlockSpec.elements(g["block_size"], self._numel(p)))
                for g in self.param_groups
                for p in g["params"]
                if shard_info(p) is not None and self._is_8bit(p, g)
            ],
            allow_split=False,
        )

    # ------------------------------------------------------------------ groups and checks

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            group["betas"] = tuple(group["betas"])
            group["qmaps"] = tuple(group["qmaps"])
            self._validate_group(group)
            gi = len(self.param_groups) - 1
            for i, p in enumerate(group["params"]):
                self._check_param(gi, i, p, group)
        except ValueError:
            self.param_groups.pop()
            raise

    @staticmethod
    def _validate_group(g: dict[str, Any]) -> None:
        lr = scalar(g["lr"])
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not g["eps"] >= 0.0:
            raise ValueError(f"eps must be >= 0, got {g['eps']}")
        if not g["weight_decay"] >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")
        b1, b2 = g["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {g['betas']}")
        bs = g["block_size"]
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
            raise ValueError(f"block_size must be a positive int, got {bs!r}")
        if not isinstance(g["min_8bit_size"], int) or g["min_8bit_size"] < 0:
            raise ValueError(f"min_8bit_size must be an int >= 0, got {g['min_8bit_size']!r}")
        qm = g["qmaps"]
        if len(qm) != 2 or any(f not in FORMATS for f in qm):
            raise ValueError(f"qmaps must be (m format, v format) with formats from {FORMATS}, got {qm!r}")
        if qm[0] == "dynamic_unsigned":
            raise ValueError("qmaps[0] (the first moment, signed) cannot be 'dynamic_unsigned'")

    @staticmethod
    def _numel(p: Tensor) -> int:
        return math.prod(full_shape(p))

    def _is_8bit(self, p: Tensor, group: dict[str, Any]) -> bool:
        return self._numel(p) >= group["min_8bit_size"]

    def _label(self, p: Tensor) -> str:
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    named = f" ({names[i]!r})" if names else ""
                    return f"param_groups[{gi}]['params'][{i}]{named} with shape {tuple(full_shape(p))}"
        return f"param with shape {tuple(full_shape(p))}"

    def _check_param(self, gi: int, i: int, p: Tensor, group: dict[str, Any]) -> None:
        what = lambda: self._label(p)
        if p.is_complex():
            raise ValueError(
                f"{what()} is complex ({p.dtype}); AdamW8bit supports real params only: view it as real "
                "(torch.view_as_real) in the model, or optimize it with torch.optim.AdamW."
            )
        if not p.is_floating_point():
            raise ValueError(f"{what()} has dtype {p.dtype}; AdamW8bit optimizes floating-point params only")
        if self._is_8bit(p, group) and p.dtype != torch.float32:
            raise ValueError(
                f"{what()} is {p.dtype}; 8-bit state needs fp32 master params (keep the params fp32 and compute in "
                "low precision with fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)), "
                f"or raise min_8bit_size above {self._numel(p)} so it keeps fp32 state)"
            )
        if is_dtensor(p):
            from ragged_optim.sharding.owner_routes import dtensor_local_ranges

            dtensor_local_ranges(p)  # raises a clear error for placements other than Shard(0) on a 1-D mesh

    # ------------------------------------------------------------------ layout

    def _local_range(self, p: Tensor, block_size: int) -> tuple[int, int]:
        """This rank's flat element range of ``p``, checked against the blocks it must hold whole."""
        numel = self._numel(p)
        info = shard_info(p)
        if info is not None:
            lo, hi = info.local_range
            if hi > lo and (lo % block_size or (hi != numel and hi % block_size)):
                raise RuntimeError(
                    f"{self._label(p)}: this rank holds elements [{lo}, {hi}), which cuts a quantization block of "
                    f"block_size={block_size}; AdamW8bit needs every rank's range to start and end on block "
                    "boundaries. The unit was re-planned after AdamW8bit was constructed (by another optimizer "
                    "allowing split blocks?): construct AdamW8bit last, or pass fully_shard(..., block_policy=...) "
                    "returning BlockSpec.elements(block_size, numel) for this param."
                )
            return lo, hi
        if is_dtensor(p):
            from ragged_optim.sharding.owner_routes import dtensor_local_ranges

            ranges = dtensor_local_ranges(p)
            if id(p) not in self._warned and any(a % block_size for a, b in ranges if b > a):
                self._warned.add(id(p))
                warnings.warn(
                    f"{self._label(p)} is an FSDP2 DTensor whose row chunks {ranges} cut blocks of "
                    f"block_size={block_size}: its 8-bit blocks restart at each rank's first element, so its "
                    "quantized state (and the params after a few steps) depend on the world size. Shard it with "
                    "ragged_optim.fully_shard for results identical to one process.",
                    UserWarning,
                    stacklevel=3,
                )
            return ranges[dist.get_rank(p.device_mesh.get_group())]
        return 0, numel

    # ------------------------------------------------------------------ state

    def _init_8bit_state(self, state: dict, n: int, group: dict[str, Any], device) -> None:
        bs = group["block_size"]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key, fmt in zip(("exp_avg", "exp_avg_sq"), group["qmaps"]):
            codes, scales = quantize_blockwise(torch.zeros(n, device=device), bs, fmt)
            state[f"{key}_codes"], state[f"{key}_scales"] = codes, scales

    def _check_8bit_state(self, p: Tensor, state: dict, n: int, group: dict[str, Any]) -> None:
        nb = num_blocks(n, group["block_size"])
        for key, fmt in zip(("exp_avg", "exp_avg_sq"), group["qmaps"]):
            codes, scales = state.get(f"{key}_codes"), state.get(f"{key}_scales")
            ok = (
                isinstance(codes, Tensor)
                and isinstance(scales, Tensor)
                and codes.dtype == code_dtype(fmt)
                and codes.numel() == n
                and scales.dtype == torch.float32
                and scales.numel() == nb
            )
            if not ok:
                got = "missing" if codes is None or scales is None else f"{codes.dtype}[{codes.numel()}] codes, "
                if codes is not None and scales is not None:
                    got += f"{scales.dtype}[{scales.numel()}] scales"
                raise ValueError(
                    f"{self._label(p)}: 8-bit state {key!r} does not fit this rank's {n} elements "
                    f"(want {code_dtype(fmt)}[{n}] codes for {fmt!r} and float32[{nb}] scales, got {got}); "
                    "load a state dict saved at the same world size, layout, block_size and qmaps"
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch.optim.Optimizer casts every state tensor to its param's dtype (uint8 codes would become fp32):
        # load the 8-bit entries ourselves, keeping their dtype.
        from ragged_optim.checkpoint import check_optimizer_state_dict

        check_optimizer_state_dict(self, state_dict)
        plain = dict(state_dict)
        plain["state"], codes = {}, {}
        for k, v in state_dict["state"].items():
            plain["state"][k] = {kk: vv for kk, vv in v.items() if kk not in STATE_KEYS_8BIT}
            codes[k] = {kk: vv for kk, vv in v.items() if kk in STATE_KEYS_8BIT}
        torch.optim.Optimizer.load_state_dict(self, plain)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for k, p in zip(saved_ids, params):
            # torch may hand back the caller's own tensors (step, fp32 moments): own copies, as after a file load
            for kk, vv in list(self.state[p].items()):
                if isinstance(vv, Tensor):
                    self.state[p][kk] = vv.clone()
            if codes.get(k):
                device = local(p).device
                self.state[p].update({kk: vv.to(device=device).clone() for kk, vv in codes[k].items()})
        for group in self.param_groups:
            group["betas"] = tuple(group["betas"])
            group["qmaps"] = tuple(group["qmaps"])
            for p in group["params"]:
                state = self.state.get(p)
                if state and self._is_8bit(p, group):
                    lo, hi = self._local_range(p, group["block_size"])
                    for k in ("exp_avg_scales", "exp_avg_sq_scales"):
                        if isinstance(state.get(k), Tensor):
                            state[k] = state[k].to(torch.float32)
                    self._check_8bit_state(p, state, hi - lo, group)

    def dequantized_state(self, p: Tensor) -> dict[str, Tensor]:
        """``exp_avg`` and ``exp_avg_sq`` of ``p`` as fp32 tensors of this rank's local elements (flat for 8-bit
        params); empty when ``p`` has no state yet."""
        state = self.state.get(p)
        if not state:
            return {}
        if "exp_avg" in state:
            return {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        out = {}
        for key, fmt in zip(("exp_avg", "exp_avg_sq"), group["qmaps"]):
            codes = state[f"{key}_codes"]
            out[key] = dequantize_blockwise(codes, state[f"{key}_scales"], group["block_size"], fmt)
        return out

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state on this rank: ``{"8bit": ..., "8bit_numel": ..., "fp32": ...}``."""
        out = {"8bit": 0, "8bit_numel": 0, "fp32": 0}
        for state in self.state.values():
            if "exp_avg_codes" in state:
                out["8bit"] += sum(state[k].numel() * state[k].element_size() for k in STATE_KEYS_8BIT)
                out["8bit_numel"] += state["exp_avg_codes"].numel()
            elif "exp_avg" in state:
                out["fp32"] += sum(state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
        return out

    # ------------------------------------------------------------------ step

    def _grad_of(self, p: Tensor) -> Tensor | None:
        grad = p.grad
        if grad is not None and (grad.is_sparse or getattr(grad, "layout", torch.strided) != torch.strided):
            raise ValueError(
                f"{self._label(p)} has a sparse gradient; AdamW8bit needs dense gradients "
                "(use nn.Embedding(..., sparse=False), or torch.optim.SparseAdam for that param)."
            )
        return grad

    def _step_8bit(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        bs = group["block_size"]
        lo, hi = self._local_range(p, bs)
        n = hi - lo
        lp, lg = local(p), local(grad)
        if lp.numel() != n or lg.numel() != n:
            raise RuntimeError(
                f"{self._label(p)}: local param/grad have {lp.numel()}/{lg.numel()} elements, expected {n} "
                f"(this rank's range [{lo}, {hi}))"
            )
        state = self.state[p]
        if not state:
            self._init_8bit_state(state, n, group, lp.device)
        self._check_8bit_state(p, state, n, group)
        state["step"] += 1
        if n == 0:
            return
        step = int(state["step"].item())
        contiguous = lp.is_contiguous()
        pv = lp.view(-1) if contiguous else lp.reshape(-1).clone()
        gv = lg.reshape(-1)
        if not gv.is_contiguous():
            gv = gv.contiguous()
        b1, b2 = group["betas"]
        kw = dict(step=step, lr=scalar(group["lr"]), eps=group["eps"], weight_decay=group["weight_decay"])
        s = state
        if group["qmaps"] == DEFAULT_QMAPS:
            adamw8bit_step(
                pv,
                gv,
                s["exp_avg_codes"],
                s["exp_avg_scales"],
                s["exp_avg_sq_codes"],
                s["exp_avg_sq_scales"],
                beta1=b1,
                beta2=b2,
                block_size=bs,
                **kw,
            )
        else:
            _unfused_step(pv, gv, s, group["qmaps"], bs, beta1=b1, beta2=b2, **kw)
        if not contiguous:
            lp.copy_(pv.view(lp.shape))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One optimizer step; ``closure`` (optional) re-evaluates the model and returns the loss."""
        loss, skip = self._begin_step(closure)
        if skip:
            return loss
        for group in self.param_groups:
            for p in group["params"]:
                grad = self._grad_of(p)
                if grad is None:
                    continue
                if self._is_8bit(p, group):
                    self._step_8bit(p, grad, group)
                else:
                    b1, b2 = group["betas"]
                    adamw_update_(
                        local(p),
                        local(grad),
                        self.state[p],
                        lr=scalar(group["lr"]),
                        beta1=b1,
                        beta2=b2,
                        eps=group["eps"],
                        weight_decay=group["weight_decay"],
                    )
        return loss


def _unfused_step(
    p: Tensor,
    g: Tensor,
    state: dict,
    qmaps: tuple[str, str],
    block_size: int,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """The fused kernel's arithmetic, in the same fp32 order, for any pair of formats (three passes)."""
    decay, b1, c1, b2, c2, inv_sqrt_bc2, eps32, step_size = adamw8bit_constants(
        step, lr, beta1, beta2, eps, weight_decay
    )
    m_fmt, v_fmt = qmaps
    m = dequantize_blockwise(state["exp_avg_codes"], state["exp_avg_scales"], block_size, m_fmt)
    v = dequantize_blockwise(state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], block_size, v_fmt)
    gf = g.float()
    p.mul_(decay)
    m.mul_(b1).add_(gf * c1)
    v.mul_(b2).add_((gf * gf).mul_(c2))
    denom = ieee_sqrt_(v.clone()).mul_(inv_sqrt_bc2).add_(eps32)
    p.sub_(torch.div(m, denom).mul_(step_size))
    quantize_blockwise(m, block_size, m_fmt, codes=state["exp_avg_codes"], scales=state["exp_avg_scales"])
    quantize_blockwise(v, block_size, v_fmt, codes=state["exp_avg_sq_codes"], scales=state["exp_avg_sq_scales"])
