"""AdamW with 8-bit moments: block-wise quantized state whose blocks are *layout* blocks.

Both moments of a param with at least ``min_8bit_size`` elements (its full size) are stored as one 8-bit code per
element and one fp32 scale per block of ``block_size`` consecutive elements of the flattened param. Each step runs
the kernels layer's fused update (:func:`ragged_optim.kernels.adamw8bit_step`): dequantize both moments, AdamW,
requantize, one pass per block. Smaller params keep fp32 ``exp_avg``/``exp_avg_sq`` and take torch.optim.AdamW's
exact arithmetic (:func:`ragged_optim.optim.adamw.adamw_update_`).

The three kinds of params (see :mod:`ragged_optim.optim.base`):

- plain tensors: blocks tile the flattened param from element 0;
- ragged-sharded params (``ragged_optim.fully_shard``): the constructor asks each unit to re-plan with
  ``BlockSpec.elements(block_size, numel)`` and ``allow_split=False``, so every rank's range starts on a block
  boundary. Each rank quantizes its own blocks with no communication, and the state and params are bit-identical
  to the one-process run at any world size. The step checks the layout (a RuntimeError if a range is cut).
- torch ``DTensor`` params on meshes of several dims (FSDP2 + TP, HSDP + TP): every block through the block API,
  computed in place where one rank holds it whole and alone, else by one owner over the whole mesh; the state holds
  the blocks this rank computes, in flat order (docs/parallelism.md).
- torch FSDP2 ``DTensor`` params (``Shard(0)``, 1-D mesh): torch's row chunks are not planned around blocks, but
  the blocks are still the global ones (``block_size`` elements from element 0). Each rank updates the blocks
  wholly inside its row chunk in place; a block cut by a chunk boundary is owner-computed: its grad and param
  pieces are gathered to one owner rank (one ``all_to_all`` for all cut blocks of the step, per process group),
  the owner keeps that block's 8-bit state and runs the same fused update on the whole block, and the new param
  pieces are scattered back (one ``all_to_all``). State and params are bit-identical to the one-process run at
  any world size. Owners are balanced jointly over the optimizer's DTensor 8-bit params of a group, preferring the
  rank that holds most of the block.
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
    PARAM_DTYPES,
    STATE_FORMAT_VERSION,
    adamw8bit_constants,
    adamw8bit_m_bound,
    adamw8bit_m_bound_of,
    adamw8bit_m_bound_sq_next,
    adamw8bit_step,
    code_dtype,
    dequantize_blockwise,
    num_blocks,
    quantize_blockwise,
)
from ragged_optim.kernels.adamw8bit_ref import adamw8bit_ref, ieee_sqrt_
from ragged_optim.optim.adamw import adamw_group_update_
from ragged_optim.optim.base import (
    full_shape,
    is_dtensor,
    is_range_layout,
    local,
    local_range,
    local_ranges,
    process_group,
    runs_of_rank,
)
from ragged_optim.optim.optimizer import RaggedOptimizer, check_eps_in_dtype, check_int, check_real, check_reals
from ragged_optim.sharding import BlockSpec, shard_info
from ragged_optim.sharding.dtensor_layout import check_placements
from ragged_optim.sharding.state_schema import Blocks, Elem, Replicated

__all__ = ["AdamW8bit", "DEFAULT_QMAPS", "STATE_KEYS_8BIT"]

#: (first moment format, second moment format). Chosen by measured convergence: docs/adamw8bit.md.
DEFAULT_QMAPS = ("dynamic", "dynamic_unsigned")
#: 8-bit state formats ``load_state_dict`` reads (1 is converted to the current one, see ``_convert_v_to_sqrt``).
_STATE_FORMATS = (1, STATE_FORMAT_VERSION)
#: State entries of an 8-bit param, besides ``step``.
STATE_KEYS_8BIT = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


class AdamW8bit(RaggedOptimizer):
    """AdamW (decoupled weight decay) with 8-bit block-wise quantized moments.

    Args:
        params: tensors or param groups (plain, ragged-sharded, or FSDP2 DTensor ``Shard(0)``). Params with 8-bit
            state may be fp32, bf16 or fp16: a bf16/fp16 param's update is computed in fp32 and stored rounded to
            the nearest value, so an update below half its spacing is lost (as in bitsandbytes' 8-bit optimizers;
            fp32 master params, e.g. ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16))``,
            keep them).
        lr, betas, eps, weight_decay: AdamW's (``torch.optim.AdamW`` meaning; ``p *= 1 - lr * weight_decay``).
        block_size: elements per quantization block (one fp32 scale each, per moment).
        min_8bit_size: params with fewer elements (full, unsharded size) keep full state (in the param's dtype, as
            torch's) and equal ``torch.optim.AdamW`` exactly.
        qmaps: ``(m format, v format)``, formats of :mod:`ragged_optim.kernels` (``"dynamic"``,
            ``"dynamic_unsigned"``, ``"int8"``, ``"fp8_e4m3"``). The default takes the fused kernel; other choices
            run the same arithmetic unfused (dequantize, update, quantize) and exist to compare maps.

    State of an 8-bit param: ``step`` (fp32 scalar tensor), ``exp_avg_codes`` / ``exp_avg_sq_codes`` (one code per
    local element: uint8, int8 for the ``"int8"`` format) and ``exp_avg_scales`` / ``exp_avg_sq_scales`` (fp32, one
    per local block). Other params: torch's ``step``, ``exp_avg``, ``exp_avg_sq``. ``state_dict`` holds this rank's
    state (same world size and layout to load it back). For a DTensor param the 8-bit entries hold the global
    blocks this rank computes: first those wholly inside its row chunk, then the chunk-boundary-cut blocks it owns
    (in element order); :meth:`state_ranges` names their flat element ranges.
    """

    layout_keys = ("block_size", "min_8bit_size", "qmaps")

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
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            block_size=block_size,
            min_8bit_size=min_8bit_size,
            qmaps=qmaps,
            state_format=STATE_FORMAT_VERSION,
        )
        self._validate_group(defaults)
        # Ragged 8-bit params: their units re-plan so no rank boundary cuts a block (a collective on each unit).
        super().__init__(params, defaults, allow_split=False)

    def block_spec(self, p: Tensor, group: dict[str, Any]) -> BlockSpec | None:
        """8-bit params compute on quantization blocks of ``block_size`` elements; the rest are element-wise."""
        return BlockSpec.elements(group["block_size"], self._numel(p)) if self._is_8bit(p, group) else None

    # ------------------------------------------------------------------ groups and checks

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._validate_group(group)
            gi = len(self.param_groups) - 1
            for i, p in enumerate(group["params"]):
                self._check_param(gi, i, p, group)
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    @staticmethod
    def _validate_group(g: dict[str, Any]) -> None:
        """Check a group's values (types, then ranges); betas and qmaps become tuples in place."""
        lr = check_real("lr", g["lr"], tensor=True)
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not check_real("weight_decay", g["weight_decay"]) >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")
        if not check_real("eps", g["eps"]) > 0.0:
            raise ValueError(
                f"eps must be > 0 for AdamW8bit, got {g['eps']}: an element whose moments are both 0 (a gradient "
                "that has always been 0, or whose second moment underflowed) would divide 0 by 0 and write NaN "
                "into the param. Use a small positive eps such as 1e-8"
            )
        version = g.get("state_format", STATE_FORMAT_VERSION)
        if version not in _STATE_FORMATS:
            raise ValueError(
                f"state_format={version!r} is not one this version of ragged-optim reads ({_STATE_FORMATS}): a "
                "state dict saved by a newer ragged-optim? Load it with that version"
            )
        b1, b2 = g["betas"] = check_reals("betas", g["betas"], "(beta1, beta2)")
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {g['betas']}")
        bs = g["block_size"]
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
            raise ValueError(f"block_size must be a positive int, got {bs!r}")
        check_int("min_8bit_size", g["min_8bit_size"], 0)
        qm = g["qmaps"]
        if isinstance(qm, list | tuple):
            qm = g["qmaps"] = tuple(qm)
        if not isinstance(qm, tuple) or len(qm) != 2 or any(f not in FORMATS for f in qm):
            raise ValueError(f"qmaps must be (m format, v format) with formats from {FORMATS}, got {qm!r}")
        if qm[0] == "dynamic_unsigned":
            raise ValueError("qmaps[0] (the first moment, signed) cannot be 'dynamic_unsigned'")

    def _group_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        # A state dict saved before state_format existed (format 1) lacks it: load_state_dict converts that state.
        # Not self.defaults: torch's __setstate__ (run by every load) adds "differentiable" there, which our saved
        # groups never hold, so a second load into the same optimizer was refused.
        return ("lr", "betas", "eps", "weight_decay", "block_size", "min_8bit_size", "qmaps")

    def _state_keys(self, group: dict[str, Any], p: Tensor) -> tuple[str, ...]:
        return ("step", *STATE_KEYS_8BIT) if self._is_8bit(p, group) else ("step", "exp_avg", "exp_avg_sq")

    def state_schema(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """An 8-bit param's codes: the elements of the quantization blocks this rank computes; its scales: one per
        such block; ``step`` and ``m_bound_sq``: replicated. Other params: torch's AdamW state."""
        if not self._is_8bit(p, group):
            return {"step": Replicated(), "exp_avg": Elem(), "exp_avg_sq": Elem()}
        spec = self.block_spec(p, group)
        codes, scales = Blocks(spec, form="element"), Blocks(spec, form="value")
        return {
            "step": Replicated(),
            "m_bound_sq": Replicated(),
            "exp_avg_codes": codes,
            "exp_avg_sq_codes": codes,
            "exp_avg_scales": scales,
            "exp_avg_sq_scales": scales,
        }

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
        if self._is_8bit(p, group) and p.dtype not in PARAM_DTYPES:
            raise ValueError(
                f"{what()} is {p.dtype}; params with 8-bit state must be one of {PARAM_DTYPES} (or raise "
                f"min_8bit_size above {self._numel(p)} so that it keeps full-precision state)"
            )
        if not self._is_8bit(p, group):  # its full-precision state is in its dtype
            check_eps_in_dtype(what(), p, group["eps"], "eps")
        if is_dtensor(p):
            check_placements(p, f"AdamW8bit: {what()}")

    # ------------------------------------------------------------------ layout

    def _local_range(self, p: Tensor, block_size: int) -> tuple[int, int]:
        """This rank's flat element range of ``p`` (:func:`local_range`); a ragged param's is checked against the
        blocks it must hold whole (a DTensor's row chunk may cut blocks: those are owner-computed)."""
        lo, hi = local_range(p)
        numel = self._numel(p)
        if shard_info(p) is not None and hi > lo and (lo % block_size or (hi != numel and hi % block_size)):
            raise RuntimeError(
                f"{self._label(p)}: this rank holds elements [{lo}, {hi}), which cuts a quantization block of "
                f"block_size={block_size}; AdamW8bit needs every rank's range to start and end on block "
                "boundaries. The unit was re-planned after AdamW8bit was constructed (by another optimizer "
                "allowing split blocks?): construct AdamW8bit last, or pass fully_shard(..., block_policy=...) "
                "returning BlockSpec.elements(block_size, numel) for this param."
            )
        return lo, hi

    @staticmethod
    def _interior(lo: int, hi: int, numel: int, block_size: int) -> tuple[int, int]:
        """The global blocks wholly inside ``[lo, hi)``, as one flat range ``[a, b)`` (empty when ``b <= a``)."""
        if hi <= lo:
            return lo, lo
        a = -(-lo // block_size) * block_size
        b = hi if hi == numel else (hi // block_size) * block_size
        return (a, b) if b > a else (lo, lo)

    def _owned_cut_blocks(self, p: Tensor) -> list[tuple[int, int]]:
        """The chunk-boundary-cut blocks of a DTensor 8-bit param that this rank owns (element order). Owners are
        fixed by the optimizer's whole param set (the block API's routing), whichever params have grads."""
        pg = process_group(p)
        rank = dist.get_rank(pg)
        return [(s, e) for s, e, route in self._routing(pg).routed[id(p)] if route.owner == rank]

    def block_state_ranges(self, p: Tensor) -> list[list[tuple[int, int]]]:
        """Every rank's 8-bit state of an FSDP2 (DTensor) param, as flat element ranges in the order its codes and
        scales hold them (:meth:`state_ranges` of each rank): the blocks wholly inside its row chunk, then the
        chunk-boundary-cut blocks it owns. Other params: the blocks each rank computes, in order."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        if not (is_dtensor(p) and self._is_8bit(p, group)) or not is_range_layout(p):
            return super().block_state_ranges(p)  # (an N-D DTensor's: the blocks each rank computes, in order)
        bs, numel = group["block_size"], self._numel(p)
        owners = self._routing(process_group(p)).routed[id(p)]
        out = []
        for r, (lo, hi) in enumerate(local_ranges(p)):
            a, b = self._interior(lo, hi, numel, bs)
            out.append([(a, b)] + [(s, e) for s, e, route in owners if route.owner == r])
        return out

    def state_ranges(self, p: Tensor, group: dict[str, Any] | None = None) -> list[tuple[int, int]]:
        """Flat element ranges ``[s, e)`` of the full param that this rank's state of ``p`` holds, in the order of
        the state tensors (and of :meth:`dequantized_state`): ``[(0, numel)]`` for a plain param, this rank's range
        for a ragged one (and for any param with fp32 state); for a DTensor 8-bit param, the blocks wholly inside
        its row chunk, then the chunk-boundary-cut blocks this rank owns."""
        if group is None:
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        bs = group["block_size"]
        if self._is_nd(p, group):
            return self.block_state_ranges(p)[dist.get_rank(process_group(p))]
        if is_dtensor(p) and not is_range_layout(p):  # fp32 state, shaped like the local piece: its runs
            return [(lo, hi) for lo, hi, _ in runs_of_rank(p, dist.get_rank(process_group(p)), replicas=True)]
        lo, hi = self._local_range(p, bs)
        if not (is_dtensor(p) and shard_info(p) is None and self._is_8bit(p, group)):
            return [(lo, hi)]
        a, b = self._interior(lo, hi, self._numel(p), bs)
        return [(a, b)] + self._owned_cut_blocks(p)

    def _is_nd(self, p: Tensor, group: dict[str, Any]) -> bool:
        """An 8-bit DTensor param whose ranks do not each hold one flat range (FSDP2 + TP, HSDP + TP): every block
        goes through the block API, the ones this rank holds alone in place, the others to their owner; its state
        holds the blocks this rank computes, in order (:meth:`block_state_ranges`)."""
        return is_dtensor(p) and self._is_8bit(p, group) and not is_range_layout(p)

    def _state_parts(self, p: Tensor, group: dict[str, Any]) -> list[tuple[int, int]]:
        """``(elements, blocks)`` of each part of the 8-bit state (parts quantize separately: a partial last block
        of the param may sit inside the first part)."""
        bs = group["block_size"]
        parts = []
        for i, (s, e) in enumerate(self.state_ranges(p, group)):
            if i == 0 or e > s:
                parts.append((max(0, e - s), num_blocks(max(0, e - s), bs)))
        return parts or [(0, 0)]  # (a rank computing none of an N-D DTensor's blocks: empty state)

    # ------------------------------------------------------------------ state

    def _init_8bit_state(self, state: dict, parts: list[tuple[int, int]], group: dict[str, Any], device) -> None:
        bs = group["block_size"]
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
        state["m_bound_sq"] = 0.0  # C_t**2 of the m clamp, kept per step as the betas may change (kernels)
        for key, fmt in zip(("exp_avg", "exp_avg_sq"), group["qmaps"]):
            q = [quantize_blockwise(torch.zeros(n, device=device), bs, fmt) for n, _ in parts]
            if len(q) == 1:
                state[f"{key}_codes"], state[f"{key}_scales"] = q[0]
            else:
                state[f"{key}_codes"] = torch.cat([c for c, _ in q])
                state[f"{key}_scales"] = torch.cat([sc for _, sc in q])

    def _check_8bit_state(self, p: Tensor, state: dict, parts: list[tuple[int, int]], group: dict[str, Any]) -> None:
        n, nb = sum(n for n, _ in parts), sum(b for _, b in parts)
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

    def _load_checked_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch.optim.Optimizer casts every state tensor to its param's dtype (uint8 codes would become fp32):
        # load the 8-bit entries ourselves, keeping their dtype.
        self._check_state_dict(state_dict)
        plain = dict(state_dict)
        plain["state"], codes = {}, {}
        for k, v in state_dict["state"].items():
            plain["state"][k] = {kk: vv for kk, vv in v.items() if kk not in STATE_KEYS_8BIT}
            codes[k] = {kk: vv for kk, vv in v.items() if kk in STATE_KEYS_8BIT}
        # The 8-bit fit check below needs the loaded groups: on failure, put the old state and groups back
        # (torch's loader installs new objects and leaves the old ones untouched).
        old = {"state": self.state, "param_groups": self.param_groups}
        try:
            self._load_into(plain, state_dict, codes)
        except Exception:
            self.__setstate__(old)
            raise

    def _load_into(self, plain: dict[str, Any], state_dict: dict[str, Any], codes: dict) -> None:
        torch.optim.Optimizer.load_state_dict(self, plain)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for k, p in zip(saved_ids, params):
            # torch may hand back the caller's own tensors (step, fp32 moments): own copies, as after a file load
            for kk, vv in list(self.state[p].items()):
                if isinstance(vv, Tensor):
                    self.state[p][kk] = vv.clone()
            if codes.get(k):  # flat, however they were saved (a plain param's state dict shapes them like it)
                device = local(p).device
                self.state[p].update({kk: vv.to(device=device).reshape(-1).clone() for kk, vv in codes[k].items()})
        converted = 0
        for group in self.param_groups:
            group["betas"] = tuple(group["betas"])
            group["qmaps"] = tuple(group["qmaps"])
            version = group.get("state_format", 1)
            for p in group["params"]:
                state = self.state.get(p)
                if state and self._is_8bit(p, group):
                    for k in ("exp_avg_scales", "exp_avg_sq_scales"):
                        if isinstance(state.get(k), Tensor):
                            state[k] = state[k].to(torch.float32)
                    self._check_8bit_state(p, state, self._state_parts(p, group), group)
                    if "m_bound_sq" not in state:  # saved before it was kept: as if the betas had been constant
                        step = int(state["step"])
                        state["m_bound_sq"] = adamw8bit_m_bound(step, *group["betas"]) ** 2 if step else 0.0
                    if version == 1:
                        self._convert_v_to_sqrt(p, state, group)
                        converted += 1
            group["state_format"] = STATE_FORMAT_VERSION
        if converted:
            warnings.warn(
                f"AdamW8bit.load_state_dict: converted the 8-bit state of {converted} param(s) from state format 1 "
                f"(second moment v stored as is) to format {STATE_FORMAT_VERSION} (sqrt(v), no positive value "
                "stored as 0); elements whose v had been stored as 0 with a non-zero first moment m get "
                "sqrt(v) = |m| (docs/adamw8bit.md, 'State format')",
                UserWarning,
                stacklevel=3,
            )

    def _convert_v_to_sqrt(self, p: Tensor, state: dict, group: dict[str, Any]) -> None:
        """Format 1 -> current, in place: ``exp_avg_sq`` codes held ``v``; they now hold ``sqrt(v)``. Where format 1
        had rounded a non-zero ``v`` to 0 (the cause of its runaway steps) the true ``v`` is lost: ``sqrt(v)`` takes
        ``|m|`` there, the least value fp32 Adam's ``|m| <= ~sqrt(v)`` allows, so the next update is at most ~lr."""
        bs = group["block_size"]
        m_fmt, v_fmt = group["qmaps"]
        n0 = b0 = 0
        for n, nb in self._state_parts(p, group):
            codes = state["exp_avg_sq_codes"][n0 : n0 + n]
            scales = state["exp_avg_sq_scales"][b0 : b0 + nb]
            m = dequantize_blockwise(
                state["exp_avg_codes"][n0 : n0 + n], state["exp_avg_scales"][b0 : b0 + nb], bs, m_fmt
            )
            r = ieee_sqrt_(dequantize_blockwise(codes, scales, bs, v_fmt).contiguous())
            r = torch.where((r == 0) & (m != 0), m.abs(), r)
            quantize_blockwise(r, bs, v_fmt, codes=codes, scales=scales)
            n0, b0 = n0 + n, b0 + nb

    def dequantized_state(self, p: Tensor) -> dict[str, Tensor]:
        """``exp_avg`` and ``exp_avg_sq`` of ``p`` as fp32 tensors of this rank's local elements (flat for 8-bit
        params; for a DTensor 8-bit param, the elements of :meth:`state_ranges`); empty when ``p`` has no state
        yet."""
        state = self.state.get(p)
        if not state:
            return {}
        if "exp_avg" in state:
            return {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        out = {}
        for key, fmt in zip(("exp_avg", "exp_avg_sq"), group["qmaps"]):
            codes, scales, vals, n0, b0 = state[f"{key}_codes"], state[f"{key}_scales"], [], 0, 0
            for n, nb in self._state_parts(p, group):
                vals.append(dequantize_blockwise(codes[n0 : n0 + n], scales[b0 : b0 + nb], group["block_size"], fmt))
                n0, b0 = n0 + n, b0 + nb
            out[key] = vals[0] if len(vals) == 1 else torch.cat(vals)
        r = out["exp_avg_sq"]
        out["exp_avg_sq"] = r * r  # stored as sqrt(v): the value the step squares back
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

    def _update(self, pv: Tensor, gv: Tensor, state: dict, n0: int, b0: int, group: dict[str, Any]) -> None:
        """The 8-bit update of whole blocks ``pv``/``gv`` on the state's elements from ``n0`` and blocks from ``b0``."""
        n, bs = pv.numel(), group["block_size"]
        nb = num_blocks(n, bs)
        s = {k: state[k][n0 : n0 + n] for k in ("exp_avg_codes", "exp_avg_sq_codes")}
        s.update({k: state[k][b0 : b0 + nb] for k in ("exp_avg_scales", "exp_avg_sq_scales")})
        b1, b2 = group["betas"]
        kw = dict(
            step=int(state["step"].item()),
            lr=self._group_lr(group),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            m_bound=adamw8bit_m_bound_of(state["m_bound_sq"]),
        )
        state_args = (s["exp_avg_codes"], s["exp_avg_scales"], s["exp_avg_sq_codes"], s["exp_avg_sq_scales"])
        if group["qmaps"] == DEFAULT_QMAPS:
            adamw8bit_step(pv, gv, *state_args, beta1=b1, beta2=b2, block_size=bs, **kw)
        else:  # other formats: the fused kernel's torch reference, the same fp32 arithmetic for any pair
            consts = adamw8bit_constants(kw["step"], kw["lr"], b1, b2, kw["eps"], kw["weight_decay"])
            adamw8bit_ref(pv, gv, *state_args, bs, (*consts, kw["m_bound"]), formats=group["qmaps"])

    def _step_8bit(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> tuple | None:
        """Updates the blocks this rank holds whole; for a DTensor param returns ``(p, flat local param, flat
        local grad, group)`` for the cut blocks (updated by :meth:`_cut_blocks`), else None."""
        bs = group["block_size"]
        if self._is_nd(p, group):
            lo, hi = 0, local(p).numel()
        else:
            lo, hi = self._local_range(p, bs)
        n = hi - lo
        lp, lg = local(p), local(grad)
        if lp.numel() != n or lg.numel() != n:
            raise RuntimeError(
                f"{self._label(p)}: local param/grad have {lp.numel()}/{lg.numel()} elements, expected {n} "
                f"(this rank's range [{lo}, {hi}))"
            )
        dtensor = is_dtensor(p) and shard_info(p) is None
        parts = self._state_parts(p, group)
        state = self.state[p]
        if not state:
            self._init_8bit_state(state, parts, group, lp.device)
        self._check_8bit_state(p, state, parts, group)
        state["step"] += 1
        state["m_bound_sq"] = adamw8bit_m_bound_sq_next(state["m_bound_sq"], *group["betas"])
        if n == 0 and not (dtensor or self._is_nd(p, group)):  # (a DTensor's step is a collective: never skipped)
            return None
        contiguous = lp.is_contiguous()
        pv = lp.view(-1) if contiguous else lp.reshape(-1).clone()
        gv = lg.reshape(-1)
        if not gv.is_contiguous():
            gv = gv.contiguous()
        if self._is_nd(p, group):
            return p, pv, gv, group, None if contiguous else lp
        if dtensor:
            a, b = self._interior(lo, hi, self._numel(p), bs)
            if b > a:
                self._update(pv[a - lo : b - lo], gv[a - lo : b - lo], state, 0, 0, group)
            return p, pv, gv, group, None if contiguous else lp
        self._update(pv, gv, state, 0, 0, group)
        if not contiguous:
            lp.copy_(pv.view(lp.shape))
        return None

    def _cut_blocks(self, items: list[tuple]) -> None:
        """The chunk-boundary-cut blocks of DTensor params, through the block API: param and grad pieces gathered
        to the owners (one all_to_all per process group), each owner updates its blocks of a param whole, in one
        fused call on their concatenation (its state holds them in that order), and the new param pieces are
        scattered back into the local params (one all_to_all). Collective: every rank calls it with the same
        params."""
        group_of = {id(p): group for p, _pv, _gv, group, _lp in items}

        def update(blocks):
            by_param: dict[int, list] = {}
            for b in blocks:
                by_param.setdefault(id(b.param), []).append(b)
            for bs in by_param.values():
                p, group = bs[0].param, group_of[id(bs[0].param)]
                parts = self._state_parts(p, group)
                if self._is_nd(p, group):  # its state: every block it computes, in flat order, from 0
                    bs.sort(key=lambda b: b.start)
                    n0, b0 = 0, 0
                else:  # its state: the interior blocks, then the cut ones
                    n0, b0 = parts[0]
                pbuf = torch.cat([b.values[0] for b in bs])
                gbuf = torch.cat([b.values[1] for b in bs])
                self._update(pbuf, gbuf, self.state[p], n0, b0, group)
                for b, piece in zip(bs, torch.split(pbuf, [b.numel for b in bs])):
                    b.values[0].copy_(piece)
            return [b.values[0] for b in blocks]

        self.map_blocks(
            update,
            [p for p, *_ in items],
            [(pv, gv.to(torch.float32)) for _p, pv, gv, _g, _lp in items],
            out=[pv for _p, pv, *_ in items],
            local_blocks=[self._is_nd(p, g) for p, _pv, _gv, g, _lp in items],  # (1-D ones did their interior)
        )
        for _p, pv, _gv, _group, lp in items:
            if lp is not None:
                lp.copy_(pv.view(lp.shape))

    # torch.compile(opt.step) runs it eagerly: dynamo fails inside it (on the 8-bit kernels' views)
    # and the step is fused kernels already
    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One optimizer step; ``closure`` (optional) re-evaluates the model and returns the loss."""
        loss, skip = self._begin_step(closure)
        if skip:
            return loss
        cut: list[tuple] = []  # DTensor params' cut blocks
        for group in self.param_groups:
            fp32: tuple[list, list, list] = ([], [], [])  # params with fp32 state: one foreach AdamW per group
            for p in group["params"]:
                grad = self._grad_of(p)
                if grad is None:
                    continue
                if self._is_8bit(p, group):
                    item = self._step_8bit(p, grad, group)
                    if item is not None:
                        cut.append(item)
                else:
                    for lst, x in zip(fp32, (p, grad, self.state[p])):
                        lst.append(x)
            adamw_group_update_(*fp32, group)
        if cut:
            self._cut_blocks(cut)
        return loss
