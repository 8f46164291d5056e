"""An optimizer built before ``fully_shard`` raises at its first ``step()``, naming the param and the fix.

``fully_shard`` replaces a module's params with sharded ones. An optimizer built before it (``opt =
torch.optim.AdamW(model.parameters())``, then ``fully_shard(model)``) still holds the old tensors: they are in no
module any more, never get a gradient, and every step skips them, so training silently does nothing. PyTorch
FSDP2 has the same trap and says nothing (tests/sharding/test_replaced_params.py runs it as the control).

Here ``fully_shard`` marks each param it replaces (:func:`mark_replaced`: the param's name in the sharded module,
and a weak reference to that module), and the first call installs one global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) that runs before every ``step()`` of every
``torch.optim.Optimizer`` in the process: torch's, ours, anyone's. It raises a RuntimeError on the first marked
param it finds. The hook runs on every step of every optimizer, so it is cheap: an optimizer whose param groups
have the sizes they had at its last check is not checked again (a dict lookup and one ``len`` per group);
``add_param_group`` changes the sizes, so the new group is checked at the next step.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["REPLACED_ATTR", "REPLACED_IN_ATTR", "check_optimizer", "mark_replaced"]

#: set on each param a unit replaced (its name); the optimizers read it too (optim/nonfinite.py)
REPLACED_ATTR = "_ragged_replaced_by"
REPLACED_IN_ATTR = "_ragged_replaced_in"  # a weakref to the module whose fully_shard replaced it

# optimizer -> the param-group sizes it had when it last passed the check
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_installed = False
_install_lock = threading.Lock()


def mark_replaced(param: torch.Tensor, name: str, module: torch.nn.Module) -> None:
    """Mark ``param`` as replaced by ``module``'s ``fully_shard`` (where it was called ``name``), and make sure the
    step pre-hook that looks for such params is installed."""
    setattr(param, REPLACED_ATTR, name)
    setattr(param, REPLACED_IN_ATTR, weakref.ref(module))
    if not _installed:
        _install()


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            register_optimizer_step_pre_hook(_step_pre_hook)
            _installed = True


def _step_pre_hook(optimizer, args, kwargs) -> None:
    sizes = tuple(len(group["params"]) for group in optimizer.param_groups)
    try:
        if _checked.get(optimizer) == sizes:
            return None
    except TypeError:  # an optimizer that cannot be weakly referenced: checked every step
        check_optimizer(optimizer)
        return None
    check_optimizer(optimizer)
    _checked[optimizer] = sizes
    return None


def check_optimizer(optimizer) -> None:
    """Raise a RuntimeError naming the first param of ``optimizer`` that ``fully_shard`` replaced."""
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            name = getattr(p, REPLACED_ATTR, None)
            if name is not None:
                raise RuntimeError(_message(optimizer, gi, i, p, name))


def _message(optimizer, gi: int, i: int, p: torch.Tensor, name: str) -> str:
    module = getattr(p, REPLACED_IN_ATTR, lambda: None)()
    where = f" in {_user_class(module).__name__}" if module is not None else ""
    return (
        f"{type(optimizer).__name__}: param_groups[{gi}]['params'][{i}] ({name!r}{where}) with shape "
        f"{tuple(p.shape)} was replaced by fully_shard after the optimizer was built: the optimizer holds the old "
        "tensor, which is in no module any more and never gets a gradient, so every step would silently train "
        "nothing; build the optimizer after fully_shard, from model.parameters() (the sharded params): "
        "fully_shard(...) first, then opt = ...(model.parameters())"
    )


def _user_class(module: torch.nn.Module) -> type:
    """The module's own class, not the one fully_shard mixed in (RaggedFSDP<Class>)."""
    ours = ("ragged_optim.sharding", "torch.distributed.fsdp")
    return next((c for c in type(module).__mro__ if not c.__module__.startswith(ours)), type(module))
