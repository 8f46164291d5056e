"""The base class of our optimizers: the step prologue they share, hyperparameter type checks, and state loading
that checks its input."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ragged_optim.optim.base import full_shape, local, scalar
from ragged_optim.optim.blocks import BlockOptimizer
from ragged_optim.optim.nonfinite import guard_step
from ragged_optim.optim.state_checks import check_optimizer_state_dict
from ragged_optim.optim.state_schema import state_from_dcp
from ragged_optim.sharding.dtensor_layout import check_placements


def _shown(value: Any) -> str:
    return f"{value!r} of type {type(value).__name__}"


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # a bool is a typo here, not a number


def check_real(name: str, value: Any, *, tensor: bool = False) -> float:
    """``value`` as a float (for range checks), or a TypeError naming ``name``, the value and what is expected.
    With ``tensor``, a real 1-element tensor passes too (torch.optim allows a tensor lr)."""
    if tensor and isinstance(value, torch.Tensor) and value.numel() == 1:
        if value.device.type != "cpu":  # the step reads it on the host: on a GPU, a device sync every step
            raise ValueError(
                f"{name} is a tensor on {value.device}, which every step would read back to the host (a device "
                f"sync); pass a float, or a CPU tensor ({name}=torch.tensor(..., device='cpu')) to change it in place"
            )
        if not (value.is_complex() or value.dtype == torch.bool):
            return value.item()
    if _is_real(value):
        return float(value)
    expected = "a real number (int or float)" + (" or a 1-element tensor" if tensor else "")
    raise TypeError(f"{name} must be {expected}, got {_shown(value)}")


def check_reals(name: str, value: Any, form: str) -> tuple:
    """``value``, a list or tuple of as many real numbers as ``form`` (e.g. ``"(beta1, beta2)"``) names, as a tuple;
    else a TypeError naming ``name``, the value and the expected form."""
    n = form.count(",") + 1
    if isinstance(value, list | tuple) and len(value) == n and all(_is_real(v) for v in value):
        return tuple(value)
    raise TypeError(f"{name} must be {form}, a tuple of {n} real numbers, got {_shown(value)}")


def check_int(name: str, value: Any, at_least: int) -> int:
    """A count or size: an int (not a bool) of at least ``at_least``, or a ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < at_least:
        raise ValueError(f"{name} must be an int >= {at_least}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """A flag must be a bool: ``bool("false")`` is True, so a string would silently mean the opposite."""
    if isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be True or False, got {_shown(value)}")


def check_eps_in_dtype(label: str, p: torch.Tensor, eps: float, name: str) -> None:
    """Warn when an AdamW eps kept in ``p``'s dtype (state in the param's dtype, as torch.optim.AdamW's, whose
    arithmetic ours matches bit for bit) is 0 there: in fp16, 1e-8 (the default) and 1e-10 are, and an element whose
    grad and second moment are 0 then steps by 0/0 = NaN (as with torch.optim.AdamW), which the non-finite check
    (it reads grads) cannot see. A warning, not an error: the defaults are torch's."""
    if p.is_floating_point() and eps > 0 and torch.tensor(eps, dtype=p.dtype).item() == 0:
        warnings.warn(
            f"{label} is {p.dtype} and its AdamW eps={eps} is 0 in that dtype: an element whose grad and second "
            f"moment are 0 will step by 0/0 = NaN (the state is kept in the param's dtype, as torch.optim.AdamW's). "
            f"Pass {name} >= {torch.finfo(p.dtype).smallest_normal:g}, or keep the params in float32 with mp_policy",
            UserWarning,
            stacklevel=4,
        )


# torch optimizers' flags that change the update; accepted as group keys by torch (any key is), ignored by ours
_UNSUPPORTED_FLAGS = ("maximize", "amsgrad")


class RaggedOptimizer(BlockOptimizer):
    """A :class:`BlockOptimizer` (a ``torch.optim.Optimizer``: param groups, state_dict, LR schedulers, on plain,
    ragged-sharded and FSDP2 params) with our optimizers' shared checks. Subclasses start ``step`` with
    ``loss, skip = self._begin_step(closure)``."""

    #: what ``set_nonfinite_policy`` looks for: ``step`` checks grads (a class marker, so that module need not
    #: import this one, which imports it)
    checks_nonfinite_grads = True
    #: the non-finite policy and the count of skipped steps are settings a copy keeps
    _settings_attrs = (*BlockOptimizer._settings_attrs, "nonfinite", "found_nonfinite")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after refusing torch optimizer flags that change the math and that this optimizer does not
        implement: torch keeps any key of a group, so ``{"params": ..., "maximize": True}`` was silently ignored
        (the optimizer minimized)."""
        if isinstance(param_group, dict):
            for key in _UNSUPPORTED_FLAGS:
                if key not in self.defaults and param_group.get(key):
                    raise ValueError(
                        f"{type(self).__name__}: param group key {key}={param_group[key]!r} (torch.optim.AdamW's) is "
                        f"not implemented here and would be ignored; remove it"
                        + (" (negate the loss to maximize)" if key == "maximize" else "")
                    )
        super().add_param_group(param_group)

    def _check_dtensor(self, gi: int, i: int, p: torch.Tensor) -> None:
        """Refuse a DTensor param no step can take (``Partial`` placements: summands, not pieces, of the param); any
        mix of ``Shard(d)``, ``_StridedShard`` and ``Replicate`` on a mesh of any dims is taken."""
        check_placements(p, f"{type(self).__name__}: {self._param_label(gi, i)}")

    def _begin_step(self, closure) -> tuple[object, bool]:
        """Run the closure; from now on the sharded layouts shape this optimizer's state, so lock them; check the
        grads (``guard_step``: non-finite grads skip the step on every rank, by default). Returns (loss, skip)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._lock_block_layouts()
        self.__dict__["_lr_this_step"] = {}
        return loss, guard_step(self)

    def _group_lr(self, group: dict[str, Any]) -> float:
        """``group["lr"]`` as a number, read once per group and step (a tensor lr on a GPU costs a host sync per
        read; a scheduler's change between steps is seen at the next step)."""
        cache = self.__dict__.setdefault("_lr_this_step", {})
        key = id(group)
        if key not in cache:
            cache[key] = scalar(group["lr"])
        return cache[key]

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

    # ------------------------------------------------------------------ what a loaded state dict must carry

    @staticmethod
    def _validate_group(group: dict[str, Any]) -> None:
        """Check (and normalize in place) a group's hyperparameters; subclasses raise TypeError/ValueError."""

    def _group_keys(self, group: dict[str, Any]) -> Iterable[str]:
        """The hyperparameter keys ``step`` reads from ``group`` (a saved group, in load_state_dict): the
        constructor's defaults, less the key torch's ``__setstate__`` (run by every load, and by unpickling) adds
        to them, which saved groups never hold."""
        return [k for k in self.defaults if k != "differentiable"]

    def _state_keys(self, group: dict[str, Any], p: torch.Tensor) -> Iterable[str]:
        """The keys ``step`` reads from the non-empty state of ``p`` in ``group``."""
        return ()

    def _check_state_dict(self, state_dict: Any) -> None:
        """Everything load_state_dict checks before it changes anything. torch's loader checks only group sizes,
        so a state dict of another optimizer class would load and then fail deep inside ``step``."""
        where = f"{type(self).__name__}.load_state_dict"
        if not (
            isinstance(state_dict, dict)
            and isinstance(state_dict.get("state"), dict)
            and isinstance(state_dict.get("param_groups"), list)
        ):
            raise TypeError(f"{where}: expected a dict with 'state' and 'param_groups' (from state_dict())")
        saved = state_dict["param_groups"]
        for gi, g in enumerate(saved):
            missing = [k for k in self._group_keys(g) if k not in g]
            if missing:
                raise ValueError(
                    f"{where}: saved param_groups[{gi}] lacks the hyperparameter(s) {missing} that "
                    f"{type(self).__name__} needs: a state dict saved by another optimizer class? Load it into "
                    "an optimizer of the class that saved it"
                )
            try:
                self._validate_group(dict(g))  # a copy: nothing may change before every check has passed
            except (TypeError, ValueError) as e:
                raise type(e)(f"{where}: saved param_groups[{gi}]: {e}") from e
        if (diff := self.layout_difference(saved)) is not None:
            gi, key, a, b = diff
            raise ValueError(
                f"{where}: saved param_groups[{gi}] has {key}={a!r}, this optimizer {b!r}; {key} decides how the "
                f"params are cut into blocks and the shape of the state, so the state loads only into an optimizer "
                f"built with {key}={a!r}"
            )
        check_optimizer_state_dict(self, state_dict)
        for gi, (g, group) in enumerate(zip(saved, self.param_groups)):
            for i, (key, p) in enumerate(zip(g["params"], group["params"])):
                st = state_dict["state"].get(key)
                missing = [k for k in self._state_keys(g, p) if k not in st] if st else []
                if missing:
                    raise ValueError(
                        f"{where}: the saved state of {self._param_label(gi, i)} lacks {missing} (it has "
                        f"{sorted(st)}): a state dict saved by another optimizer class, or with other param groups?"
                    )

    def state_dict(self) -> dict[str, Any]:
        """torch's, with ``torch.dtype`` hyperparameters (Muon's ``ns_dtype``) as strings ("torch.bfloat16"):
        torch's get_optimizer_state_dict and DCP keep only plain types. load_state_dict turns them back."""
        sd = super().state_dict()  # (ragged and FSDP2 params' state as (Ragged)DTensors: BlockOptimizer's)
        for g in sd["param_groups"]:
            for k, v in g.items():
                if isinstance(v, torch.dtype):
                    g[k] = str(v)
        return sd

    @staticmethod
    def _dtypes_back(state_dict: Any) -> Any:
        if not (isinstance(state_dict, dict) and isinstance(state_dict.get("param_groups"), list)):
            return state_dict
        groups = []
        for g in state_dict["param_groups"]:
            if isinstance(g, dict):
                g = {k: _as_dtype(v) for k, v in g.items()}
            groups.append(g)
        return {**state_dict, "param_groups": groups}

    def load_state_dict(self, state_dict) -> None:
        """torch's loader checks only group sizes; first make sure the state was saved for these params and by
        this optimizer class (:meth:`_check_state_dict`), so that a failed load changes nothing. State of ragged params
        given as full tensors or (Ragged)DTensors (torch's set_optimizer_state_dict, DCP) becomes local pieces first.
        The ``register_load_state_dict_pre_hook`` hooks run first, as in torch (a hook may fix up an old state dict
        before it is checked); the post-hooks once everything is loaded."""
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict  # (torch's shallow copy)
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        # torch's loader would run the hooks again (and the post-hooks before a subclass has loaded all its state)
        pre, post = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        try:
            local_pieces = state_from_dcp(self, self._dtypes_back(state_dict))
            self._load_checked_state_dict(_steps_on_cpu(local_pieces))
        finally:
            self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = pre, post
        self.record_layout()  # (the load checked them)
        for hook in list(post.values()):
            hook(self)

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype | None:
        """The dtype this optimizer keeps the floating state of ``p`` in, where that is not ``p``'s own (Shampoo's and
        SOAP's statistics are float32 for bf16 params); None: ``p``'s dtype, as torch's loader assumes."""
        return None

    def _load_checked_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check ``state_dict`` (its hooks run, its state as local pieces), then load it with torch's loader. torch
        casts every floating state tensor (nested ones too) to its param's dtype: the state of params whose
        :meth:`_state_dtype` differs is loaded here instead (torch's cast would bring a bf16 param's float32
        preconditioners back as bf16, rounded, and the next step would raise on mixed dtypes)."""
        self._check_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        kept, state = [], dict(state_dict["state"])
        for k, p in zip(ids, params):
            dtype = self._state_dtype(p)
            if dtype is not None and dtype != local(p).dtype and isinstance(state.get(k), dict):
                kept.append((p, dtype, {kk: v for kk, v in state[k].items() if kk != "step"}))
                state[k] = {kk: v for kk, v in state[k].items() if kk == "step"}
        torch.optim.Optimizer.load_state_dict(self, {**state_dict, "state": state})
        for p, dtype, entries in kept:
            self.state[p].update(_moved(entries, local(p).device, dtype))


def _moved(v, device: torch.device, dtype: torch.dtype):
    """``v`` (a tensor, or dicts / lists / tuples of them) copied to ``device``, floating tensors in ``dtype``."""
    if isinstance(v, torch.Tensor):
        return v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
    if isinstance(v, dict):
        return {k: _moved(x, device, dtype) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return type(v)(_moved(x, device, dtype) for x in v)
    return v


def _steps_on_cpu(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every 0-d ``step`` counter on the CPU, where our optimizers keep it: torch's loader leaves
    it where it comes (a checkpoint read onto the params' GPU), and every step reads it on the host."""
    state = state_dict.get("state") if isinstance(state_dict, dict) else None
    if not isinstance(state, dict):
        return state_dict  # (the checks say what is wrong)
    moved = {}
    for k, st in state.items():
        step = st.get("step") if isinstance(st, dict) else None
        if isinstance(step, torch.Tensor) and step.dim() == 0 and step.device.type not in ("cpu", "meta"):
            st = {**st, "step": step.cpu()}
        moved[k] = st
    return {**state_dict, "state": moved}


def _as_dtype(v):
    """ "torch.bfloat16" -> torch.bfloat16 (how state_dict stores dtype hyperparameters); anything else as is."""
    if isinstance(v, str) and v.startswith("torch."):
        d = getattr(torch, v[len("torch.") :], None)
        if isinstance(d, torch.dtype):
            return d
    return v
