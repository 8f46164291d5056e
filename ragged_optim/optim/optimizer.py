"""The base class of our optimizers: the step prologue they share and state loading that checks its input."""

from __future__ import annotations

import torch

from ragged_optim.optim.base import full_shape, lock_layouts
from ragged_optim.optim.nonfinite import guard_step


class RaggedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` (param groups, state_dict, LR schedulers) that also runs on ragged-sharded and
    FSDP2 params. Subclasses start ``step`` with ``loss, skip = self._begin_step(closure)``."""

    def _begin_step(self, closure) -> tuple[object, bool]:
        """Run the closure; from now on the sharded layouts shape this optimizer's state, so lock them; check the
        grads (``guard_step``: non-finite grads skip the step on every rank, by default). Returns (loss, skip)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.__dict__.get("_layouts_locked"):
            lock_layouts(p for g in self.param_groups for p in g["params"])
            self._layouts_locked = True
        return loss, guard_step(self)

    def _param_label(self, gi: int, i: int) -> str:
        """How error messages name a param: its place in the groups, its name when given, its full shape."""
        group = self.param_groups[gi]
        p = group["params"][i]
        names = group.get("param_names")
        named = f" ({names[i]!r})" if names else ""
        return f"param_groups[{gi}]['params'][{i}]{named} with shape {tuple(full_shape(p))}"

    def _grad_of(self, gi: int, i: int, p: torch.Tensor) -> torch.Tensor | None:
        """``p.grad``, refusing sparse gradients with a message that names the param and the fix."""
        grad = p.grad
        if grad is not None and grad.is_sparse:
            raise ValueError(
                f"{self._param_label(gi, i)} has a sparse gradient; {type(self).__name__} needs dense gradients "
                "(use nn.Embedding(..., sparse=False), or torch.optim.SparseAdam for that param)."
            )
        return grad

    def load_state_dict(self, state_dict) -> None:
        """torch's loader checks only group sizes; first make sure the state was saved for these params."""
        from ragged_optim.checkpoint import check_optimizer_state_dict

        check_optimizer_state_dict(self, state_dict)
        super().load_state_dict(state_dict)
