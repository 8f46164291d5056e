"""Which params of a model get Muon and which get AdamW.

Muon is meant for the weight matrices of hidden layers. Embedding tables and the output head are 2-D as well but
behave like per-token lookups rather than linear maps between hidden states, and 1-D params (biases, norm gains)
are not matrices at all; all of those go to AdamW. ``Muon(model.parameters())`` can only look at shapes, so it
puts embeddings and the head on Muon: use :func:`muon_param_groups` to route by module.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn
from torch.nn.utils import parametrize

from ragged_optim.optim.base import full_shape  # sharded params are 1-D views: route by full shape
from ragged_optim.optim.muon import ADAMW_GROUP_KEYS, MUON_GROUP_KEYS

__all__ = ["HEAD_NAMES", "muon_param_groups"]

#: Last components of module names that mark an ``nn.Linear`` as an output head.
HEAD_NAMES = ("lm_head", "output", "head", "classifier")
_OVERRIDE_KEYS = (*MUON_GROUP_KEYS, *(f"adamw_{k}" for k in ADAMW_GROUP_KEYS))


def _check_overrides(overrides: dict[str, Any]) -> None:
    """A misspelt key would only become an unused group tag, and the default would apply silently."""
    unknown = [k for k in overrides if k not in _OVERRIDE_KEYS]
    if unknown:
        close = {k: difflib.get_close_matches(k, _OVERRIDE_KEYS, 1) for k in unknown}
        hints = ", ".join(f"{m[0]!r} for {k!r}" for k, m in close.items() if m)
        raise ValueError(
            f"muon_param_groups: unknown override(s) {unknown}{f' (did you mean {hints}?)' if hints else ''}; "
            f"accepted: {list(_OVERRIDE_KEYS)}. To tag the groups with keys of your own, set them on the returned dicts"
        )


def _module_ids(model: nn.Module, exclude: Iterable[str | Tensor | nn.Module]) -> set[int]:
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    if isinstance(exclude, str | Tensor | nn.Module):  # one item, not an iterable of them (chars, rows)
        exclude = [exclude]
    ids: set[int] = set()
    for item in exclude:
        if isinstance(item, nn.Module):
            ids.update(id(p) for p in item.parameters())
        elif isinstance(item, Tensor):
            ids.add(id(item))
        elif isinstance(item, str):
            if item in params:
                ids.add(id(params[item]))
            elif item in modules:
                ids.update(id(p) for p in modules[item].parameters())
            else:
                raise ValueError(f"exclude names {item!r}, which is neither a param nor a module of the model")
        else:
            raise TypeError(f"exclude takes param/module names, tensors or modules, got {type(item).__name__}")
    return ids


def _weight_ids(module: nn.Module) -> set[int]:
    """ids of the params that make ``module.weight``: the param itself, or a parametrized weight's originals
    (``weight_norm``'s g and v). Never ``module.weight`` on a parametrized module: that runs the parametrization,
    which on sharded 1-D pieces computes garbage or (``torch._weight_norm``) reads past the end of its buffers."""
    if parametrize.is_parametrized(module, "weight"):
        return {id(p) for p in module.parametrizations["weight"].parameters()}
    w = module._parameters.get("weight")
    return {id(w)} if w is not None else set()


def muon_param_groups(
    model: nn.Module,
    *,
    exclude: Iterable[str | Tensor | nn.Module] = (),
    **overrides: Any,
) -> list[dict[str, Any]]:
    """Split ``model``'s params into a Muon group and an AdamW group for :class:`ragged_optim.optim.Muon`.

    A param goes to **AdamW** when any of these holds, and to **Muon** otherwise:

    1. it has fewer than 2 dims (biases, LayerNorm/RMSNorm gains, scalars), or no elements (nothing to
       orthogonalize: AdamW's step does nothing to it);
    2. it is the weight of an ``nn.Embedding`` or ``nn.EmbeddingBag``;
    3. it is the weight of an output head, i.e. an ``nn.Linear`` that

       a. shares its weight tensor with an embedding (tied), or
       b. is named (last component of its module name) one of :data:`HEAD_NAMES`
          (``lm_head``, ``output``, ``head``, ``classifier``), or
       c. is the last ``nn.Linear`` in ``model.named_modules()`` order and its ``out_features`` equals the
          ``num_embeddings`` of an embedding in the model (an untied LM head under another name);

       (a head's bias is 1-D and so AdamW by rule 1);
    4. it is in ``exclude``: param names, module names (all of that module's params), tensors or modules; a
       single name, tensor or module may be given alone (``exclude="lm_head"``).

    A parametrized weight (``torch.nn.utils.parametrize``, ``weight_norm``) is its originals, each routed by its own
    shape (all to AdamW for an embedding or the head).

    Every param appears once, in ``model.named_parameters()`` order (tied weights are deduplicated). Frozen
    params (``requires_grad=False``) are included, as ``model.parameters()`` would.

    ``overrides`` set group hyperparameters: keys starting with ``adamw_`` go to the AdamW group with the prefix
    removed (``adamw_lr=3e-4`` -> ``lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay``); all other
    keys go to the Muon group (``lr``, ``weight_decay``, ``momentum``, ``adjust_lr``, ...). Keys not given fall
    back to the ``Muon(...)`` constructor's arguments. Any other key is a ValueError (a misspelt key would
    otherwise be ignored); to tag the groups with keys of your own, set them on the returned dicts. Empty groups
    are left out.

    Returns:
        ``[{"params": [...], "use_muon": True, ...}, {"params": [...], "use_muon": False, ...}]``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"muon_param_groups: takes the model (an nn.Module), got a {type(model).__name__}; for a list of params, "
            "build the groups yourself: [{'params': matrices, 'use_muon': True}, {'params': rest, 'use_muon': False}]"
        )
    _check_overrides(overrides)
    excluded = _module_ids(model, exclude)
    embedding_weights: set[int] = set()
    vocab_sizes: set[int] = set()
    linears: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            embedding_weights |= _weight_ids(module)
            vocab_sizes.add(module.num_embeddings)
        elif isinstance(module, nn.Linear):
            linears.append((name, module))
    head_weights: set[int] = set()
    for name, lin in linears:
        if _weight_ids(lin) & embedding_weights or name.rsplit(".", 1)[-1] in HEAD_NAMES:
            head_weights |= _weight_ids(lin)
    if linears and linears[-1][1].out_features in vocab_sizes:
        head_weights |= _weight_ids(linears[-1][1])

    muon: list[Tensor] = []
    adamw: list[Tensor] = []
    for _, p in model.named_parameters():
        pid = id(p)
        shape = full_shape(p)
        if len(shape) < 2 or 0 in shape or pid in embedding_weights or pid in head_weights or pid in excluded:
            adamw.append(p)
        else:
            muon.append(p)

    muon_opts = {k: v for k, v in overrides.items() if not k.startswith("adamw_")}
    adamw_opts = {k[len("adamw_") :]: v for k, v in overrides.items() if k.startswith("adamw_")}
    groups: list[dict[str, Any]] = []
    if muon:
        groups.append({"params": muon, "use_muon": True, **muon_opts})
    if adamw:
        groups.append({"params": adamw, "use_muon": False, **adamw_opts})
    return groups
