"""Muon's param groups: which keys a Muon group and an AdamW group of :class:`~ragged_optim.optim.muon.Muon` hold,
how a user's group becomes one of them, and the checks on their values. Plain dict work, no tensors touched."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ragged_optim.optim.base import full_shape
from ragged_optim.optim.optimizer import check_bool, check_real, check_reals

__all__ = [
    "ADAMW_GROUP_KEYS",
    "ADJUST_LR_MODES",
    "MUON_GROUP_KEYS",
    "make_group",
    "split_by_shape",
    "unused_keys",
    "validate_group",
]

ADJUST_LR_MODES = ("original", "match_rms_adamw")
# Group keys that only mean something for one kind of group; the other kind's groups do not keep them.
_MUON_ONLY_KEYS = ("momentum", "nesterov", "ns_steps", "ns_coefficients", "adjust_lr", "ns_dtype")
_ADAMW_ONLY_KEYS = ("betas",)
#: The hyperparameter keys of a Muon group (``use_muon=True``), and of an AdamW one.
MUON_GROUP_KEYS = ("lr", "eps", "weight_decay", *_MUON_ONLY_KEYS)
ADAMW_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
_ADAMW_PREFIXED = tuple(f"adamw_{k}" for k in ADAMW_GROUP_KEYS)  # the constructor's defaults for AdamW groups
_KNOWN_KEYS = frozenset({"params", "use_muon", "lr", "eps", "weight_decay", *_MUON_ONLY_KEYS, *_ADAMW_PREFIXED,
                         *_ADAMW_ONLY_KEYS})  # fmt: skip


def split_by_shape(entries: list) -> tuple[list, list]:
    """A group without ``use_muon``: its matrices (2-D and up) for Muon, the rest for AdamW. An empty matrix has
    nothing to orthogonalize: it goes to the AdamW half (where its step does nothing). Entries may be
    ``(name, tensor)`` pairs."""
    tensor = lambda e: e[1] if isinstance(e, tuple) else e
    shape = lambda e: full_shape(tensor(e))
    is_matrix = lambda e: isinstance(tensor(e), Tensor) and len(shape(e)) >= 2 and 0 not in shape(e)
    return [e for e in entries if is_matrix(e)], [e for e in entries if not is_matrix(e)]


def make_group(user: dict[str, Any], entries: list, defaults: dict[str, Any], *, use_muon: bool, split: bool) -> dict:
    """The group stored for ``entries`` of the user's group ``user``: keys we do not interpret (user tags) as they
    are; a Muon group's hyperparameters from its plain keys; an AdamW group's from its plain keys, then its
    ``adamw_*`` keys (only those when ``split``: there the plain keys belong to the Muon half), then ``defaults``."""
    group: dict[str, Any] = {"params": entries, "use_muon": use_muon}
    for k, v in user.items():
        if k not in _KNOWN_KEYS:
            group[k] = v
    d = defaults
    if use_muon:
        for k in MUON_GROUP_KEYS:
            group[k] = user.get(k, d[k])
    else:
        for short, long in (("lr", "adamw_lr"), ("betas", "adamw_betas"), ("eps", "adamw_eps")):
            group[short] = user.get(long, d[long]) if split else user.get(short, user.get(long, d[long]))
        wd = "adamw_weight_decay"
        group["weight_decay"] = user.get(wd, d[wd]) if split else user.get("weight_decay", user.get(wd, d[wd]))
    return group


def unused_keys(use_muon: bool) -> tuple[str, ...]:
    """The defaults ``Optimizer.add_param_group`` fills in that this kind of group does not use."""
    return _ADAMW_PREFIXED if use_muon else (*_MUON_ONLY_KEYS, *_ADAMW_PREFIXED)


def validate_group(g: dict[str, Any]) -> None:
    """Check a group's values (types, then ranges); normalize in place: tuples, ``adjust_lr=None``."""
    # An AdamW group's values come from adamw_* keys as well: name both in its errors.
    adamw = not check_bool("use_muon", g["use_muon"])
    name = lambda k: f"AdamW {k} (adamw_{k}, or {k} of a use_muon=False group)" if adamw else k
    lr = check_real(name("lr"), g["lr"], tensor=True)
    if not lr >= 0.0:
        raise ValueError(f"{name('lr')} must be >= 0, got {lr}")
    for k in ("weight_decay", "eps"):
        if not check_real(name(k), g[k]) >= 0.0:
            raise ValueError(f"{name(k)} must be >= 0, got {g[k]}")
    if g["use_muon"]:
        if not 0.0 <= check_real("momentum", g["momentum"]) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {g['momentum']}")
        check_bool("nesterov", g["nesterov"])
        if g["adjust_lr"] is None:
            g["adjust_lr"] = "original"
        if g["adjust_lr"] not in ADJUST_LR_MODES:
            raise ValueError(f"adjust_lr must be one of {ADJUST_LR_MODES} or None, got {g['adjust_lr']!r}")
        if not isinstance(g["ns_steps"], int) or isinstance(g["ns_steps"], bool) or not 0 <= g["ns_steps"] < 100:
            raise ValueError(f"ns_steps must be an int in [0, 100), got {g['ns_steps']!r}")
        g["ns_coefficients"] = check_reals("ns_coefficients", g["ns_coefficients"], "(a, b, c)")
        if not (isinstance(g["ns_dtype"], torch.dtype) and g["ns_dtype"].is_floating_point):
            raise ValueError(f"ns_dtype must be a floating torch.dtype (bfloat16 or float32), got {g['ns_dtype']}")
    else:
        b1, b2 = g["betas"] = check_reals(name("betas"), g["betas"], "(beta1, beta2)")
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"AdamW betas must be in [0, 1), got {g['betas']}")
