"""AdamW's elementwise step, the one torch.optim.AdamW computes, for the optimizers' full-precision params: Muon's
non-matrix params and AdamW8bit's small ones.

Three entry points with the same bits: :func:`adamw_update_` (one param, torch's single-tensor path, op for op),
:func:`adamw_foreach_update_` (many params, one ``torch._foreach_*`` call per operation) and
:func:`adamw_group_update_` (a param group's hyperparameters on this rank's local elements). Every op is elementwise,
so a param may be a whole tensor or one rank's shard of it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ragged_optim.optim.base import local, scalar

__all__ = ["adamw_foreach_update_", "adamw_group_update_", "adamw_update_", "foreach_rounds_scalars"]


def _init_state(p: Tensor, state: dict) -> None:
    """torch.optim.AdamW's state: ``step`` a float32 CPU scalar tensor, both moments zeros like ``p``."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adamw_update_(
    p: Tensor,
    grad: Tensor,
    state: dict,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step on ``p`` in place; elementwise only, so ``p``/``grad`` may be a shard.

    Same op sequence as ``torch.optim.AdamW``'s single-tensor path (bitwise equal results). ``state`` holds
    ``step`` (a float32 scalar tensor), ``exp_avg`` and ``exp_avg_sq`` (created here on first use).
    """
    _init_state(p, state)
    step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
    step_t += 1
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = step_t.item()
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-step_size)


def foreach_rounds_scalars(device: torch.device, dtype: torch.dtype) -> bool:
    """True where torch's foreach ops round a Python scalar to the tensors' dtype before using it (CPU, bf16/fp16:
    ``torch._foreach_mul_([t], 0.95)`` != ``t.mul_(0.95)``), so they cannot stand in for the single-tensor ops."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def adamw_foreach_update_(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """:func:`adamw_update_` on many params at once with ``torch._foreach_*`` ops (one multi-tensor kernel per
    operation on a GPU instead of one kernel per param and operation), grouped by device and dtype.

    Every element goes through the same fp32 operations as :func:`adamw_update_` (torch.optim.AdamW's
    single-tensor path): lerp, mul + addcmul, sqrt, divide by ``sqrt(1 - beta2**step)``, add eps, addcdiv with
    ``-lr / (1 - beta1**step)``; the results are bitwise equal (tests/optim/muon/test_muon_one_process.py,
    test_adamw8bit_one_process.py). The per-param bias corrections read ``step``, a CPU scalar tensor as in torch: no
    device sync. bf16 and fp16 params on a CPU go one by one: there torch's foreach ops round a scalar to the tensor's
    dtype first (``eps``, ``beta2``), where the single-tensor ops compute with it in fp32."""
    buckets: dict[tuple, list[int]] = {}
    for k, (p, state) in enumerate(zip(params, states)):
        _init_state(p, state)
        buckets.setdefault((p.device, p.dtype, grads[k].dtype), []).append(k)
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    for (device, dtype, _), idx in buckets.items():
        if foreach_rounds_scalars(device, dtype):
            for k in idx:
                adamw_update_(params[k], grads[k], states[k], **kw)
            continue
        ps = [params[k] for k in idx]
        gs = [grads[k] for k in idx]
        steps = [states[k]["step"] for k in idx]
        exp_avgs = [states[k]["exp_avg"] for k in idx]
        exp_avg_sqs = [states[k]["exp_avg_sq"] for k in idx]
        torch._foreach_add_(steps, 1)
        if weight_decay != 0:
            torch._foreach_mul_(ps, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, gs, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, gs, gs, value=1 - beta2)
        step_values = [s.item() for s in steps]  # CPU scalars
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, [(1 - beta2**s) ** 0.5 for s in step_values])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(ps, exp_avgs, denom, [-(lr / (1 - beta1**s)) for s in step_values])


def adamw_group_update_(
    params: list[Tensor], grads: list[Tensor], states: list[dict], group: dict, foreach: bool = True
) -> None:
    """AdamW with the hyperparameters of an AdamW param group (``lr``, ``betas``, ``eps``, ``weight_decay``) on this
    rank's local elements of each param and grad: :func:`adamw_foreach_update_`, or :func:`adamw_update_` per param
    when not ``foreach`` (the same bits)."""
    if not params:
        return
    beta1, beta2 = group["betas"]
    ps, gs = [local(p) for p in params], [local(g) for g in grads]
    kw = dict(lr=scalar(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
    if foreach:
        adamw_foreach_update_(ps, gs, states, **kw)
    else:
        for p, g, state in zip(ps, gs, states):
            adamw_update_(p, g, state, **kw)
