"""Sharded checkpoints of a model (``ragged_optim.fully_shard``, torch FSDP2 or plain) and its optimizers, in
torch's own distributed-checkpoint (DCP) format, that load at any world size.

Format (version 2). A checkpoint is a folder written by ``torch.distributed.checkpoint`` (every rank writes its own
file, in parallel) plus ``meta.pt`` (format version, optimizer classes, param groups by name, the kind of every
saved state entry, the caller's ``extra``) and a ``COMPLETE`` marker written last. The DCP keys are the ones
torch's ``dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)})`` writes:

- ``model.<name>``: every entry of ``model.state_dict()`` under its original name and full shape (a ragged param
  is written as the rectangular chunks of its ranks' pieces, see :mod:`ragged_optim.sharding.ragged_dtensor`), so
  ``dcp_to_torch_save``, a plain model and a torch FSDP2 model read it as they read their own;
- ``optim.state.<name>.<key>``: optimizer state of param ``<name>``, laid out by the kind the optimizer's state
  schema declares (:mod:`ragged_optim.sharding.state_schema`; a torch optimizer's: the default): ``Elem`` (moments,
  momentum) at the param's full shape; ``Blocks(spec, form="value")`` (8-bit scales) at ``[n_blocks]``,
  ``form="element"`` (8-bit codes) at the full shape, each rank writing the blocks it computes; ``Replicated``
  (``step``) once;
- ``optim.state.<name>.<key>.<k>[.<field>][.<i>]``: block ``k`` of a ``Blocks(spec)`` (per-block dict) entry:
  Shampoo's band ``k`` (``L``, ``R``, ``L_root``, ``R_root``, list entries ``i`` one stack of tiles per tile width,
  ``graft``, ``step``), SOAP's, a user's tiles; written by the rank that computes the block, read on load by the
  rank that computes it under the new layout;
- ``optim.param_groups.<g>.<key>``: the hyperparameters and (``params``) the param names of each group, as torch
  writes them.

Every rank contributes its own keys to DCP's metadata, so no state is dropped at any setting. Several optimizers
share the ``optim.state`` namespace (each param belongs to one); ``meta.pt`` says which groups are whose. Nothing
is classified by its name: state the optimizer's schema does not cover (or disagrees with) is refused at save, and
a load whose recorded kinds differ from the loading optimizer's schema is refused, naming the param and the key
(a checkpoint without that record, from before it existed, is read by the loading optimizer's schema).

Loading reads everything into fresh buffers first, checks every key and shape before that, and only after the read
succeeded writes the optimizers (each restored on failure) and then the model: a failed load changes nothing.
Every failure to read a checkpoint is a :class:`CheckpointError` naming the folder or file and the cause.
``load_checkpoint(path, model)`` without optimizers reads the model's weights only (of any checkpoint).
``load_checkpoint`` also reads a plain torch DCP checkpoint of a model (``dcp.save(get_model_state_dict(m))`` or
``dcp.save({"model": ...})``): model state only.

Atomicity: data goes to ``<path>.tmp-<id>``; after every rank has finished, rank 0 writes ``meta.pt``, then
``COMPLETE``, then renames the folder to ``<path>`` (an older checkpoint at ``<path>`` is moved aside first and
deleted after). A folder of ours without ``COMPLETE`` is never loaded. If a save dies between those two renames,
``load_checkpoint(path)`` loads the complete checkpoint it left (``<path>.tmp-<id>``, else ``<path>.old-<id>``) with a
warning. Each successful save then tidies what interrupted saves of any checkpoint in its folder left: unfinished
``.tmp-`` folders go, a complete leftover takes its checkpoint's name when it is the newest copy (else it goes).
:func:`latest_checkpoint` names the newest complete checkpoint of a folder, to resume from.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ragged_optim.optim.base import is_dtensor, local, process_group
from ragged_optim.optim.blocks import BlockOptimizer
from ragged_optim.optim.state_checks import check_optimizer_state_dict, declared_kinds, group_starts
from ragged_optim.optim.state_schema import block_layout, is_block_dict, kind_of
from ragged_optim.sharding import shard_info
from ragged_optim.sharding.ragged_dtensor import RaggedDTensor, ragged_dtensor
from ragged_optim.sharding.sharded_param import full_shape
from ragged_optim.sharding.state_dict import install_optimizer_hooks, optimizer_state_to_dcp, sharded_dtensor
from ragged_optim.sharding.state_schema import Blocks, Elem, Replicated, StateKind, default_kind, kind_from_record

__all__ = [
    "COMPLETE_MARKER",
    "CheckpointError",
    "check_optimizer_state_dict",
    "get_full_optimizer_state_dict",
    "is_complete",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.pt"
FORMAT_VERSION = 2
# Group hyperparameters that fix the shape of an optimizer's state: a checkpoint with other values cannot load.


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read (incomplete, corrupt, another model, another optimizer, a newer
    format); the message names the folder or file and says why. An ``Exception``, unlike torch's
    ``CheckpointException``."""


# ---------------------------------------------------------------------------------------------------------------
# small distributed helpers (all work without torch.distributed on one process)
# ---------------------------------------------------------------------------------------------------------------


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _broadcast_obj(obj):
    if not _dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_objects(obj) -> list:
    if not _dist_on():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _check_arguments(what: str, model, optimizers) -> tuple:
    """``(path, model, optimizers)`` in that order, of those types (an optimizer passed as the model failed with
    ``'Muon' object has no attribute 'named_parameters'``); returns the optimizers as a tuple."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = (optimizers,)
    if not isinstance(model, nn.Module):
        swapped = " (the arguments are (path, model, optimizers))" if isinstance(model, torch.optim.Optimizer) else ""
        raise TypeError(f"{what}: model must be an nn.Module, got a {type(model).__name__}{swapped}")
    optimizers = tuple(optimizers)
    bad = next((o for o in optimizers if not isinstance(o, torch.optim.Optimizer)), None)
    if bad is not None:
        raise TypeError(
            f"{what}: optimizers must be torch.optim.Optimizer objects (one, or a list of them), got a "
            f"{type(bad).__name__}"
        )
    return optimizers


def _as_path(path, what: str) -> str:
    try:
        return os.fsdecode(os.fspath(path))  # (a bytes path too)
    except TypeError:
        raise TypeError(f"{what}: path must be a folder path (str or os.PathLike), got {path!r}") from None


def _same_path_everywhere(path: str, what: str) -> None:
    """Every rank must name the same folder (a path built per rank, e.g. from a timestamp, left rank 0's data in one
    folder marked complete and the others' in another; a load mixed checkpoints): a CheckpointError on every rank
    before anything is written or read."""
    paths = _gather_objects(path)
    if any(p != paths[0] for p in paths):
        r = next(k for k, p in enumerate(paths) if p != paths[0])
        raise CheckpointError(
            f"{what}: ranks passed different paths ({paths[0]!r} on rank 0, {paths[r]!r} on rank {r}); pass the "
            "same path on every rank (build it on rank 0 and broadcast it, e.g. with "
            "torch.distributed.broadcast_object_list); nothing was written or read"
        )


def _agree(error: str | None) -> None:
    """Raise the first rank's error on every rank (so a check that fails on one rank fails everywhere, before any
    rank changes anything)."""
    errors = [e for e in _gather_objects(error) if e]
    if errors:
        raise CheckpointError(errors[0])


def _is_dtensor(t) -> bool:
    """A torch DTensor (FSDP2's params and state), not a ragged-sharded param (a DTensor laid out by its unit)."""
    return hasattr(t, "to_local") and hasattr(t, "placements") and shard_info(t) is None


def _describe_failure(e: BaseException) -> str:
    """The cause of a DCP failure in one line per failing rank (torch's CheckpointException carries them)."""
    failures = getattr(e, "failures", None)
    if failures:
        parts = []
        for rank, pair in sorted(failures.items()):
            exc = pair[0] if isinstance(pair, tuple) else pair
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {e}"


def _reader(path: str):
    """A FileSystemReader whose read errors name the file they came from."""
    import torch.distributed.checkpoint as dcp

    class _NamingReader(dcp.FileSystemReader):
        def _slice_file(self, file, sinfo):
            self._reading = sinfo.relative_path
            return super()._slice_file(file, sinfo)

        def read_data(self, plan, planner):
            try:
                return super().read_data(plan, planner)
            except Exception as e:
                # a file that failed to open names itself (_slice_file names only files that opened)
                failed = e.filename if isinstance(e, OSError) and e.filename else None
                where = os.fspath(failed) if failed else os.path.join(path, getattr(self, "_reading", "?"))
                cause = str(e) or ("the file ends early: truncated?" if isinstance(e, EOFError) else "no message")
                raise CheckpointError(f"file {where!r} could not be read ({type(e).__name__}: {cause})") from e

    return _NamingReader(path)


# ---------------------------------------------------------------------------------------------------------------
# naming
# ---------------------------------------------------------------------------------------------------------------


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(param) -> its name in ``model`` (tied params: the first name)."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    return names


def _opt_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _opt_fqns(model: nn.Module, opt: torch.optim.Optimizer, which: int) -> list[str]:
    names = _param_names(model)
    out = []
    for gi, g in enumerate(opt.param_groups):
        for i, p in enumerate(g["params"]):
            if id(p) not in names:
                raise CheckpointError(
                    f"optimizer {which} ({type(opt).__name__}) param_groups[{gi}]['params'][{i}] with shape "
                    f"{tuple(full_shape(p))} is not a parameter of the model. Was the optimizer built before "
                    "fully_shard (on the params fully_shard replaced)? Build it after fully_shard, from "
                    "model.parameters()"
                )
            out.append(names[id(p)])
    return out


def _group_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    for g in opt.param_groups:
        if any(q is p for q in g["params"]):
            return g
    raise KeyError("param not in optimizer")


# ---------------------------------------------------------------------------------------------------------------
# state kinds (the optimizer's declared schema: optim/state_schema.py)
# ---------------------------------------------------------------------------------------------------------------


def _dcp_state_dict(opt: torch.optim.Optimizer) -> dict:
    """``opt.state_dict()`` in DCP's form: ours convert by their schema; a torch optimizer's by the default one (its
    hooks may not be installed yet: before its first step)."""
    sd = opt.state_dict()
    return sd if getattr(opt, "converts_own_state_dict", False) else optimizer_state_to_dcp(opt, sd)


def _entry_kind(opt, p: torch.Tensor, group: dict, key: str, value: Any, label: str) -> StateKind:
    """The kind of a state entry (in state-dict form): our optimizers' declaration (state they do not cover is
    refused); for a torch optimizer the default (anything else, kept as it is, is stored once)."""
    if isinstance(opt, BlockOptimizer):
        return kind_of(opt, p, group, key, value, label)
    return default_kind(key, value, tuple(local(p).shape), tuple(full_shape(p))) or Replicated()


def _flatten_block(prefix: str, value: Any, out: dict, where: str) -> None:
    """One block's state under DCP keys: a tensor at ``prefix``, a list at ``prefix.<i>``, a dict's fields at
    ``prefix.<name>`` (a list field at ``prefix.<name>.<i>``), as DCP's own flattening writes them."""
    if isinstance(value, Mapping):
        for name, v in value.items():
            if not isinstance(name, str) or not name or name.isdigit() or "." in name:
                raise CheckpointError(
                    f"{where}: field {name!r}: a block's dict is keyed by names (strings, not numbers, without dots) "
                    "so that it reads back unambiguously; rename the field"
                )
            _flatten_leaf(f"{prefix}.{name}", v, out, where)
    else:
        _flatten_leaf(prefix, value, out, where)


def _flatten_leaf(prefix: str, value: Any, out: dict, where: str) -> None:
    items = list(enumerate(value)) if isinstance(value, list | tuple) else [(None, value)]
    for i, v in items:
        if isinstance(v, Mapping | list | tuple):
            raise CheckpointError(
                f"{where}: a block's state is a tensor, a list of tensors, or a dict of names to those (or to "
                f"numbers); {prefix!r} nests a {type(v).__name__} deeper: flatten it into named fields"
            )
        out[prefix if i is None else f"{prefix}.{i}"] = v


def _unflatten_block(entries: dict[str, Any]) -> Any:
    """The inverse of :func:`_flatten_block`, from ``{key below the block's own ('' for itself): value}``."""
    if "" in entries:
        return entries[""]
    if all(k.isdigit() for k in entries):
        return [entries[k] for k in sorted(entries, key=int)]
    out: dict[str, Any] = {}
    lists: dict[str, dict[int, Any]] = {}
    for rest, v in entries.items():
        name, _, idx = rest.partition(".")
        if idx:
            lists.setdefault(name, {})[int(idx)] = v
        else:
            out[name] = v
    for name, items in lists.items():
        out[name] = [items[i] for i in sorted(items)]
    return out


# ---------------------------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------------------------


def _optim_entries(model, opt, which: int, sd: dict, group_offset: int) -> dict:
    """Add one optimizer's DCP entries to ``sd``; return its record for meta.pt (with the kind of every saved state
    entry: the load checks it against the loading optimizer's schema)."""
    fqns = _opt_fqns(model, opt, which)
    what = f"optimizer {which} ({type(opt).__name__})"
    try:
        osd = _dcp_state_dict(opt)
    except ValueError as e:  # state the schema does not cover, or disagrees with
        raise CheckpointError(f"save_checkpoint: {what}: {e}; nothing was written") from e
    ids = [i for g in osd["param_groups"] for i in g["params"]]
    groups_of = [g for g in opt.param_groups for _ in g["params"]]
    schema: dict[str, dict[str, tuple]] = {}
    for pid, fqn, p, group in zip(ids, fqns, _opt_params(opt), groups_of):
        for key, v in (osd["state"].get(pid) or {}).items():
            try:
                kind = _entry_kind(opt, p, group, key, v, repr(fqn))
            except ValueError as e:
                raise CheckpointError(f"save_checkpoint: {what}: {e}; nothing was written") from e
            base = f"optim.state.{fqn}.{key}"
            if is_block_dict(kind):
                for b, block in v.items():
                    _flatten_block(f"{base}.{b}", block, sd, f"save_checkpoint: {what} {fqn!r} {key!r} block {b}")
            else:
                sd[base] = v
            schema.setdefault(fqn, {})[key] = kind.record()
    groups = []
    k = 0
    for gi, g in enumerate(osd["param_groups"]):
        g = dict(g)
        n = len(g["params"])
        g["params"] = fqns[k : k + n]
        k += n
        groups.append(g)
        for hk, hv in g.items():
            sd[f"optim.param_groups.{group_offset + gi}.{hk}"] = hv
    return {"class": type(opt).__name__, "fqns": fqns, "groups": groups, "schema": schema}


def _merge_schemas(records: list[dict]) -> None:
    """Every rank's kinds of the saved state into each record (a rank that computes no block of a param has no
    entry for its per-block state); a collective."""
    parts = _gather_objects([r["schema"] for r in records])
    for j, rec in enumerate(records):
        merged: dict[str, dict[str, tuple]] = {}
        for part in parts:
            for fqn, keys in part[j].items():
                for key, kind in keys.items():
                    seen = merged.setdefault(fqn, {}).setdefault(key, kind)
                    if seen != kind:
                        raise CheckpointError(
                            f"save_checkpoint: optimizer {j} ({rec['class']}) state {key!r} of {fqn!r} is "
                            f"{kind_from_record(kind)} on one rank and {kind_from_record(seen)} on another: declare "
                            "it in state_schema; nothing was written"
                        )
        rec["schema"] = merged


def _target_problem(path: str) -> str | None:
    """None when a save may put a checkpoint at ``path``: nothing there, an empty folder, or a checkpoint of ours
    (which it replaces); else why not. Nothing else is ever replaced: a save does not delete a user's files."""
    if not path:
        return "cannot write the checkpoint folder '': the path is empty; pass the folder to save into"
    if os.path.lexists(path) and not os.path.isdir(path):
        return f"cannot write the checkpoint folder {path!r}: it is a file, not a folder; nothing was written"
    if os.path.isdir(path):
        entries = sorted(os.listdir(path))
        if entries and not (is_complete(path) or os.path.isfile(os.path.join(path, META_FILE))):
            shown = ", ".join(repr(e) for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
            return (
                f"cannot write the checkpoint folder {path!r}: it holds files that are not a ragged-optim "
                f"checkpoint ({shown}), and a save replaces the whole folder; nothing was written. Save into a new "
                "or empty folder"
            )
    return None


def _writable(folder: str) -> str | None:
    """None when rank 0 can create ``folder`` and write into it, else why not."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, ".probe")
        with open(probe, "wb") as f:
            f.write(b"0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
        return None
    except OSError as e:
        why = e.strerror or e
        return f"cannot write the checkpoint folder {folder!r}: {why} (is the folder writable, with free space?)"


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
    extra: Any = None,
) -> str:
    """Save ``model`` (sharded with ``ragged_optim.fully_shard``, torch FSDP2, or plain) and ``optimizers`` to the
    folder ``path`` in torch's DCP format (see the module doc); a collective: call it on every rank. ``extra`` (any
    picklable object, e.g. ``{"step": 100}``) is stored as rank 0 has it and returned by :func:`load_checkpoint`.
    Returns ``path``.

    The folder appears only once every rank has written its part; an existing checkpoint at ``path`` is replaced.
    A folder that cannot be written, or a write that fails (disk full), raises :class:`CheckpointError` on every
    rank and leaves any older checkpoint at ``path`` as it was. State an optimizer's schema does not cover (or
    disagrees with) raises before anything is written. A successful save also tidies what interrupted saves left
    in the same folder (:func:`_clean_leftovers`)."""
    import torch.distributed.checkpoint as dcp

    optimizers = _check_arguments("save_checkpoint", model, optimizers)
    path = _as_path(path, "save_checkpoint")
    _same_path_everywhere(path, "save_checkpoint")
    started = time.time()
    token = _broadcast_obj(uuid.uuid4().hex[:12] if _rank() == 0 else None)
    tmp = f"{path}.tmp-{token}"
    sd: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    records, offset, problem = [], 0, None
    try:  # state a schema does not cover may be on some ranks only: every rank raises
        for j, opt in enumerate(optimizers):
            records.append(_optim_entries(model, opt, j, sd, offset))
            offset += len(opt.param_groups)
    except CheckpointError as e:
        problem = str(e)
    _agree(problem)
    _merge_schemas(records)
    problem = None
    if _rank() == 0:  # whatever goes wrong on rank 0 reaches every rank (the others would wait for it)
        try:
            problem = _extra_problem(extra) or _target_problem(path) or _writable(tmp)
        except Exception as e:  # e.g. a path with a NUL byte
            problem = f"cannot write the checkpoint folder {path!r}: {type(e).__name__}: {e}; nothing was written"
    problem = _broadcast_obj(problem)
    if problem:
        raise CheckpointError(problem)
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing checkpoint {path!r} failed: {_describe_failure(e)}") from e
    _barrier()  # every rank's data is on disk
    problem = None
    if _rank() == 0:
        world = dist.get_world_size() if _dist_on() else 1
        meta = {"version": FORMAT_VERSION, "world_size": world, "optimizers": records, "extra": extra}
        try:
            torch.save(meta, os.path.join(tmp, META_FILE))
            _write_marker(tmp, f"ragged-optim checkpoint v{FORMAT_VERSION}, world size {world}\n")
            _publish(tmp, path, token)
        except Exception as e:  # every rank raises, not rank 0 alone (the others would wait for it)
            shutil.rmtree(tmp, ignore_errors=True)
            why = f"{type(e).__name__}: {e}"
            problem = f"finishing checkpoint {path!r} failed: {why}; any older checkpoint there is kept"
        else:
            _clean_leftovers(path, started)
    problem = _broadcast_obj(problem)
    if problem:
        raise CheckpointError(problem)
    return path


def _extra_problem(extra: Any) -> str | None:
    """Why ``extra`` cannot be stored (it is pickled into meta.pt), checked before anything is written."""
    try:
        pickle.dumps(extra)
    except Exception as e:
        return (
            f"save_checkpoint(extra=...) must be picklable (it is stored with torch.save): {type(e).__name__}: {e}; "
            "nothing was written. Store plain values (numbers, strings, lists, dicts, tensors)"
        )
    return None


def _write_marker(folder: str, text: str) -> None:
    marker = os.path.join(folder, COMPLETE_MARKER)
    with open(marker, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: str, path: str, token: str) -> None:
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{token}"
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except OSError:
        if old is not None:  # put the older checkpoint back
            os.replace(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_LEFTOVER = re.compile(r"^(?P<name>.+)\.(?P<kind>tmp|old)-[^/]+$")


def _only_checkpoint_files(folder: str) -> bool:
    """Whether ``folder`` holds nothing but what a save writes (DCP's data and metadata, meta.pt, the probe)."""
    ours = re.compile(r"^(__\d+_\d+\.distcp|\.metadata.*|meta\.pt|\.probe|" + re.escape(COMPLETE_MARKER) + ")$")
    return all(ours.match(e) for e in os.listdir(folder))


def _completed_at(folder: str) -> int:
    return os.stat(os.path.join(folder, COMPLETE_MARKER)).st_mtime_ns


def _clean_leftovers(path: str, started: float) -> None:
    """After a successful save (rank 0): what interrupted saves of any checkpoint in the same folder left, when it
    was last changed before this save began (another job's save in flight is left alone). An unfinished
    ``<name>.tmp-<id>`` (no COMPLETE: a rank died while writing) is removed. Of a name's complete copies (the
    checkpoint ``<name>`` itself, a ``.tmp-`` folder whose rename was cut short, an ``.old-`` one moved aside) the
    newest takes the name and the others are removed: a complete leftover that is the newest checkpoint is
    promoted, never deleted. A failure here is a warning: the checkpoint just saved is complete."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    try:
        copies: dict[str, list[str]] = {}
        for entry in sorted(os.listdir(parent)):
            m = _LEFTOVER.match(entry)
            folder = os.path.join(parent, entry)
            if not m or not os.path.isdir(folder) or os.path.getmtime(folder) >= started:
                continue
            if is_complete(folder):
                copies.setdefault(m["name"], []).append(folder)
            elif m["kind"] == "tmp" and _only_checkpoint_files(folder):
                shutil.rmtree(folder, ignore_errors=True)
        for name, found in copies.items():
            target = os.path.join(parent, name)
            if os.path.lexists(target) and not is_complete(target):
                continue  # something else under that name: touch nothing
            newest = max(found + ([target] if os.path.lexists(target) else []), key=_completed_at)
            if newest != target:
                aside = None
                if os.path.lexists(target):
                    aside = f"{target}.old-{uuid.uuid4().hex[:12]}"
                    os.replace(target, aside)
                os.replace(newest, target)
                if aside is not None:
                    shutil.rmtree(aside, ignore_errors=True)
            for folder in found:
                if folder != newest:
                    shutil.rmtree(folder, ignore_errors=True)
    except OSError as e:
        warnings.warn(
            f"save_checkpoint: the checkpoint at {path!r} is complete, but tidying what interrupted saves left in "
            f"{parent!r} failed ({type(e).__name__}: {e})",
            UserWarning,
            stacklevel=3,
        )


def latest_checkpoint(folder: str | os.PathLike) -> str | None:
    """The newest complete checkpoint in ``folder`` (by the time its save completed), or None when there is none:
    what to resume from after a crash. A save that died while writing left no complete folder, so the one before
    it is returned; one that died after completing, before its folder took its name, left a complete
    ``<name>.tmp-<id>``, which is returned as it is (it loads; the next save gives it its name). Reads the file
    system only (no collective): on a shared file system every rank gets the same answer."""
    folder = _as_path(folder, "latest_checkpoint")
    if not os.path.isdir(folder):
        return None
    found = [os.path.join(folder, e) for e in sorted(os.listdir(folder)) if is_complete(os.path.join(folder, e))]
    return max(found, key=_completed_at, default=None)


def _siblings(path: str, kind: str) -> list[str]:
    """``<path><kind><id>`` folders (``.tmp-``: a save's data; ``.old-``: the checkpoint a publish moved aside),
    newest first."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    base = os.path.basename(os.path.abspath(path))
    if not os.path.isdir(parent):
        return []
    found = [os.path.join(parent, d) for d in os.listdir(parent) if d.startswith(base + kind)]
    return sorted((f for f in found if os.path.isdir(f)), key=os.path.getmtime, reverse=True)


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a checkpoint folder whose write finished (it has the ``COMPLETE`` marker)."""
    return os.path.isfile(os.path.join(os.fspath(path), COMPLETE_MARKER))


def _is_torch_dcp(path: str) -> bool:
    """A folder torch's dcp.save wrote (``.metadata``) that is not one of ours (no ``meta.pt``, no ``COMPLETE``:
    one of ours that lost its ``meta.pt`` is corrupt, not torch's)."""
    return (
        os.path.isfile(os.path.join(path, ".metadata"))
        and not os.path.exists(os.path.join(path, META_FILE))
        and not is_complete(path)
    )


def _resolve(path: str) -> str:
    """The folder to load for ``path``: ``path`` itself, or, when a save died between moving the older checkpoint
    aside and renaming the new one into place (nothing at ``path``), the complete checkpoint it left: the new one
    (its ``.tmp-`` folder has every rank's data, ``meta.pt`` and ``COMPLETE``), else the older one (``.old-``)."""
    if os.path.lexists(path):
        return path
    for folder in _siblings(path, ".tmp-") + _siblings(path, ".old-"):
        if is_complete(folder):
            warnings.warn(
                f"load_checkpoint: nothing at {path!r}, where a save was interrupted while replacing the checkpoint; "
                f"loading the complete checkpoint it left, {folder!r} (the next save in that folder gives it its name)",
                UserWarning,
                stacklevel=4,  # (_resolve, _open, load_checkpoint, the caller)
            )
            return folder
    return path


def _require_complete(path: str) -> None:
    if is_complete(path):
        return
    partial = [os.path.basename(f) for f in _siblings(path, ".tmp-") if not is_complete(f)]
    if os.path.isdir(path):
        why = f"checkpoint {path!r} has no {COMPLETE_MARKER} marker and no torch DCP '.metadata' file: its write "
        why += "was interrupted (a rank died or ran out of disk before every rank finished), or it is not a "
        why += "checkpoint folder; load an earlier checkpoint"
    elif partial:
        why = f"no checkpoint at {path!r}; an interrupted write left {partial} without a {COMPLETE_MARKER} marker "
        why += "(a rank died while saving); load an earlier checkpoint"
    else:
        why = f"no checkpoint at {path!r} (no such folder with a {COMPLETE_MARKER} marker)"
    raise CheckpointError(why)


# ---------------------------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------------------------


def _open(path: str) -> tuple[str, bool, dict | None, Any]:
    """(the folder to read, whether it is a plain torch DCP checkpoint, our record or None, DCP's metadata)."""
    path = _resolve(path)
    torch_ckpt = os.path.isdir(path) and _is_torch_dcp(path)
    if not torch_ckpt:
        _require_complete(path)
    meta = None if torch_ckpt else _read_meta(path)
    return path, torch_ckpt, meta, _read_dcp_metadata(path)


def _read_meta(path: str) -> dict:
    where = os.path.join(path, META_FILE)
    try:
        meta = torch.load(where, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"file {where!r} could not be read ({type(e).__name__}: {e})") from e
    version = meta.get("version") if isinstance(meta, dict) else None
    if not isinstance(version, int):
        raise CheckpointError(f"file {where!r} is not a ragged-optim checkpoint record (no format version)")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path!r} was written by a newer ragged-optim (format version {version}; this one reads "
            f"up to {FORMAT_VERSION}): upgrade ragged-optim to load it"
        )
    if version < FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path!r} has format version {version} (flat 1-D ShardedTensor entries), which this "
            f"ragged-optim (format {FORMAT_VERSION}: full shapes) no longer reads: load it with the release that "
            "wrote it, export with get_full_state_dict, and load that with load_full_state_dict"
        )
    return meta


def _read_dcp_metadata(path: str):
    where = os.path.join(path, ".metadata")
    try:
        return _reader(path).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"file {where!r} could not be read ({type(e).__name__}: {e})") from e


def _fresh_like(v: torch.Tensor, dtype=None) -> torch.Tensor:
    """An empty stand-in for state-dict entry ``v`` to read into (same layout, nothing aliased)."""
    if isinstance(v, RaggedDTensor):
        return v._rewrap(torch.empty_like(v.to_local(), dtype=dtype))
    if _is_dtensor(v):
        from torch.distributed.tensor import DTensor

        local = torch.empty_like(v.to_local(), dtype=dtype)
        return DTensor.from_local(local, v.device_mesh, v.placements, shape=v.shape, stride=v.stride(), run_check=False)
    return torch.empty_like(v.detach(), dtype=dtype)


def _model_request(path: str, model: nn.Module, stored: dict, prefix: str) -> dict[str, Any]:
    """Fresh buffers for every model entry, after checking names, shapes and dtypes against the checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    own = model.state_dict()
    saved = {k[len(prefix) :] for k in stored if k.startswith(prefix) and not k.startswith("optim.")}
    missing = [n for n in own if n not in saved]
    unexpected = sorted(n for n in saved if n not in own)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path!r} is from another model: the model has {missing[:4]} which the checkpoint lacks, "
            f"the checkpoint has {unexpected[:4]} which the model lacks. Build the model the checkpoint was saved "
            "from (same module names)"
        )
    request = {}
    for n, v in own.items():
        md = stored[prefix + n]
        if isinstance(v, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {path!r}: {n!r} is not a tensor in the checkpoint")
            if tuple(md.size) != tuple(v.shape):
                raise CheckpointError(
                    f"checkpoint {path!r}: {n!r} has shape {tuple(md.size)} in the checkpoint but {tuple(v.shape)} "
                    "in the model; the checkpoint is from a differently shaped model (check the model config)"
                )
            if md.properties.dtype != v.dtype:
                raise CheckpointError(
                    f"checkpoint {path!r}: {n!r} is {md.properties.dtype} in the checkpoint but {v.dtype} in the "
                    "model; cast the model to the saved dtype before loading (or load the full state dict and cast)"
                )
            request[prefix + n] = _fresh_like(v)
        else:
            request[prefix + n] = v
    return request


def _check_optimizer(path: str, rec: dict, model, opt, which: int) -> list[str]:
    fqns = _opt_fqns(model, opt, which)
    if rec["class"] != type(opt).__name__:
        raise CheckpointError(
            f"checkpoint {path!r}: optimizer {which} was a {rec['class']} but is a {type(opt).__name__} now; "
            "pass the optimizers in the order they were saved, of the classes they were saved with"
        )
    sizes = [len(g["params"]) for g in opt.param_groups]
    saved_sizes = [len(g["params"]) for g in rec["groups"]]
    if sizes != saved_sizes or fqns != rec["fqns"]:
        diff = sorted(set(fqns) ^ set(rec["fqns"]))
        raise CheckpointError(
            f"checkpoint {path!r}: optimizer {which} ({type(opt).__name__}) holds other params than the saved one "
            f"(group sizes {sizes} vs saved {saved_sizes}; params in only one of them: {diff[:4]}). Build the "
            "optimizer with the same param groups, in the same order, as when it was saved"
        )
    if isinstance(opt, BlockOptimizer) and (diff := opt.layout_difference(rec["groups"])) is not None:
        gi, k, saved, here = diff
        raise CheckpointError(
            f"checkpoint {path!r}: optimizer {which} ({type(opt).__name__}) param_groups[{gi}] has {k}={here!r} but "
            f"the checkpoint was saved with {k}={saved!r}: its state has another shape. Build the optimizer with "
            f"{k}={saved!r}"
        )
    return fqns


def _reading_kinds(path: str, opt, fqn: str, saved: dict, declared: dict) -> dict[str, StateKind]:
    """The kind to read each saved state key of ``fqn`` as: the one recorded at the save (checked against the
    loading optimizer's declaration), else the declared one (a checkpoint of a version that recorded none)."""
    cls = type(opt).__name__
    out = dict(declared)
    for key, rec in saved.items():
        kind = kind_from_record(rec)
        if kind is None:
            raise CheckpointError(
                f"checkpoint {path!r}: state {key!r} of {fqn!r} was saved as {rec!r}, a kind this ragged-optim "
                "does not know: upgrade ragged-optim to load it"
            )
        want = declared.get(key)
        if want is not None and want != kind:
            raise CheckpointError(
                f"checkpoint {path!r}: state {key!r} of {fqn!r} was saved as {kind}, but {cls}.state_schema "
                f"declares it {want}: it would load as the wrong thing. Load it into the optimizer (and settings) "
                "that saved it, or make state_schema declare what the checkpoint holds; nothing was loaded"
            )
        if want is None and isinstance(kind, Blocks):
            raise CheckpointError(
                f"checkpoint {path!r}: state {key!r} of {fqn!r} was saved per block ({kind}), which {cls}."
                "state_schema does not declare for this param: each block's state is read by the rank that computes "
                "the block, so the loading optimizer must declare it; nothing was loaded"
            )
        out[key] = kind
    return out


def _elem_buffer(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty element-wise state entry of ``p`` in its state-dict form (what DCP reads this rank's part into)."""
    lp = local(p)
    info = shard_info(p)
    if info is not None:
        return sharded_dtensor(torch.empty(lp.numel(), dtype=dtype, device=lp.device), info)
    if is_dtensor(p):
        return DTensor.from_local(
            torch.empty(lp.shape, dtype=dtype, device=lp.device),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )
    return torch.empty(p.shape, dtype=dtype, device=p.device)


def _default_reading_kind(key: str, md, p) -> StateKind:
    """The kind of a saved entry no record or declaration names (a torch optimizer's, an older checkpoint's):
    element-wise when it has the param's full shape (a 0-d param: every 0-d entry but torch's ``step``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(md, TensorStorageMetadata):
        size, fs = tuple(md.size), tuple(full_shape(p))
        if size == fs and (size != () or key != "step"):
            return Elem()
    return Replicated()


def _optim_request(path, opt, p, fqn: str, group: dict, rec: dict, stored: dict, request: dict, claimed: list):
    """Fresh buffers, by kind, for the saved state of ``p`` this rank needs (a per-block entry: the blocks it
    computes); returns ``{key: (kind, DCP key)}`` or, per block, ``{key: (kind, {block: {field: DCP key}}, all
    saved blocks)}``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    base = f"optim.state.{fqn}."
    mine = {k[len(base) :]: md for k, md in stored.items() if k.startswith(base)}
    kinds = _reading_kinds(path, opt, fqn, (rec.get("schema") or {}).get(fqn, {}), declared_kinds(opt, p, group))
    dict_keys = [k for k, kind in kinds.items() if is_block_dict(kind)]
    leaves: dict[str, Any] = {}
    blocks: dict[str, dict[int, dict[str, str]]] = {}
    for rest, md in mine.items():
        key = next((k for k in dict_keys if rest.startswith(k + ".")), None)
        if key is None:
            if "." in rest and rest not in kinds:
                top = rest.split(".")[0]
                raise CheckpointError(
                    f"checkpoint {path!r}: state {top!r} of {fqn!r} is saved as nested entries ({rest!r}, ...) that "
                    f"{type(opt).__name__}.state_schema does not declare per block: declare it "
                    f"ro.Blocks(self.block_spec(p, group)) so that each block is read by the rank that computes it; "
                    "nothing was loaded"
                )
            leaves[rest] = md
            continue
        index, _, field = rest[len(key) + 1 :].partition(".")
        if not index.isdigit():
            raise CheckpointError(
                f"checkpoint {path!r}: state {key!r} of {fqn!r} has an entry {rest!r} not keyed by a block index"
            )
        blocks.setdefault(key, {}).setdefault(int(index), {})[field] = base + rest
    out: dict[str, Any] = {}
    distributed = process_group(p) is not None
    for key, md in leaves.items():
        full_key = base + key
        kind = kinds.get(key) or _default_reading_kind(key, md, p)
        if not isinstance(md, TensorStorageMetadata):
            request[full_key] = None  # a Python object (DCP stores it as bytes)
            out[key] = (kind, full_key)
            continue
        dtype, size = md.properties.dtype, tuple(md.size)
        if isinstance(kind, Elem):
            if size != tuple(full_shape(p)):
                raise CheckpointError(
                    f"checkpoint {path!r}: element-wise state {key!r} of {fqn!r} has shape {size}, the param "
                    f"{tuple(full_shape(p))}: saved for another model?"
                )
            request[full_key] = _elem_buffer(p, dtype)
        elif (
            isinstance(kind, Blocks) and distributed and kind.form == "element" and size == (math.prod(full_shape(p)),)
        ):
            # a plain param's codes as an older version saved them (flat): read whole, cut by load_state_dict
            request[full_key] = torch.empty(size, dtype=dtype, device=local(p).device)
        elif isinstance(kind, Blocks) and distributed:
            shape, ranges = block_layout(opt, p, kind)
            if size != tuple(shape):
                raise CheckpointError(
                    f"checkpoint {path!r}: per-block state {key!r} of {fqn!r} has shape {size}, but {kind} of the "
                    f"param has {tuple(shape)}: saved with another block size, or for another model?"
                )
            rank = dist.get_rank(process_group(p))
            n = sum(b - a for a, b in ranges[rank])
            buf = torch.empty(n, dtype=dtype, device=local(p).device)
            request[full_key] = ragged_dtensor(buf, shape, ranges, rank, process_group(p))
        else:  # replicated (a 0-d counter stays on the CPU, where the optimizers keep it: no device sync per read)
            device = "cpu" if size == () else local(p).device
            request[full_key] = torch.empty(size, dtype=dtype, device=device)
        out[key] = (kind, full_key)
    for key, saved_blocks in blocks.items():
        here = set(opt.blocks_computed_here(p))
        wanted = {}
        for b in sorted(set(saved_blocks) & here):
            for full_key in saved_blocks[b].values():
                md = stored[full_key]
                if isinstance(md, TensorStorageMetadata):
                    request[full_key] = torch.empty(md.size, dtype=md.properties.dtype, device=local(p).device)
                else:
                    request[full_key] = None
            wanted[b] = saved_blocks[b]
            claimed.append((fqn, key, b))
        out[key] = (kinds[key], wanted, sorted(saved_blocks))
    for key in dict_keys:  # declared, nothing saved (no rank computed one of its blocks yet): an empty dict
        if key not in out and key in (rec.get("schema") or {}).get(fqn, {}):
            out[key] = (kinds[key], {}, [])
    return out


def _loaded_state(plan: dict, request: dict) -> dict:
    """One param's loaded state from its :func:`_optim_request` plan: local pieces, per-block dicts rebuilt."""
    st = {}
    for key, entry in plan.items():
        if len(entry) == 3:
            _, wanted, _ = entry
            st[key] = {
                b: _unflatten_block({field: request[full] for field, full in fields.items()})
                for b, fields in wanted.items()
            }
        else:
            v = request[entry[1]]
            st[key] = v.to_local() if isinstance(v, RaggedDTensor) else v
    return st


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
) -> Any:
    """Load a checkpoint of :func:`save_checkpoint` (or a torch DCP checkpoint of a model: model state only) into
    ``model`` and ``optimizers`` at the current world size and layouts (any world size: pieces are resharded); a
    collective: call it on every rank after building the optimizers. Returns the saved ``extra`` (None for a torch
    checkpoint). All or nothing: every check runs and every tensor is read before anything is written. Without
    optimizers only the model's weights are read (from any checkpoint); optimizers must be those the checkpoint
    was saved with. Raises :class:`CheckpointError` for an incomplete or corrupt checkpoint, another model, other
    optimizers, or optimizer state saved as another kind than the optimizer's schema declares."""
    import torch.distributed.checkpoint as dcp

    from ragged_optim.optim.blocks import lock_layouts

    optimizers = _check_arguments("load_checkpoint", model, optimizers)
    path = _as_path(path, "load_checkpoint")
    _same_path_everywhere(path, "load_checkpoint")
    try:  # each rank reads the folder itself (it may be node-local): every rank raises if one cannot
        path, torch_ckpt, meta, stored, problem = *_open(path), None
    except CheckpointError as e:
        problem = f"{e} (on rank {_rank()})" if _dist_on() and dist.get_world_size() > 1 else str(e)
    _agree(problem)
    if torch_ckpt:
        prefix = "model." if any(k.startswith("model.") for k in stored) else ""
        if optimizers:
            raise CheckpointError(
                f"checkpoint {path!r} is a plain torch DCP checkpoint: load_checkpoint reads its model state only "
                "and it lacks ragged-optim's optimizer record (meta.pt). Load it with optimizers=() (the model "
                "only), or load optimizer state with torch's set_optimizer_state_dict"
            )
    else:
        prefix = "model."
        if optimizers and len(optimizers) != len(meta["optimizers"]):
            raise CheckpointError(
                f"checkpoint {path!r} holds {len(meta['optimizers'])} optimizers, {len(optimizers)} were given; pass "
                "the same optimizers, in the same order, as to save_checkpoint (or none, to load the model's "
                "weights only)"
            )
    request = _model_request(path, model, stored, prefix)
    plans, claimed, problem = [], [], None
    for j, opt in enumerate(optimizers):
        rec = meta["optimizers"][j]
        fqns = _check_optimizer(path, rec, model, opt, j)
        try:
            plans.append(
                {
                    fqn: _optim_request(path, opt, p, fqn, _group_of(opt, p), rec, stored, request, claimed)
                    for p, fqn in zip(_opt_params(opt), fqns)
                }
            )
        except CheckpointError as e:  # (a schema check may fail on the ranks that compute a block only)
            problem = problem or str(e)
    _agree(problem)
    # Every saved block must be read by the rank that computes it now: otherwise its state would be lost.
    all_claimed = set().union(*[set(c) for c in _gather_objects(claimed)])
    for plan in plans:
        for fqn, pst in plan.items():
            for key, entry in pst.items():
                lost = [b for b in entry[2] if (fqn, key, b) not in all_claimed] if len(entry) == 3 else []
                if lost and problem is None:
                    problem = (
                        f"checkpoint {path!r}: blocks {lost[:4]} of {key!r} of {fqn!r} would be read by no rank "
                        "under the current layout (another block size, max_preconditioner_dim?)"
                    )
    _agree(problem)
    try:
        dcp.load(request, storage_reader=_reader(path))
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        raise CheckpointError(f"checkpoint {path!r}: reading failed: {_describe_failure(e)}") from e
    # Everything is read and checked: now write, optimizers first (each restores itself on failure), model last.
    done = []
    try:
        for opt, rec, plan in zip(optimizers, meta["optimizers"] if meta else [], plans):
            params = _opt_params(opt)
            index = {fqn: i for i, fqn in enumerate(rec["fqns"])}
            state = {}
            for fqn, pst in plan.items():
                st = _loaded_state(pst, request)
                if st:
                    state[index[fqn]] = st
            groups = []
            for g in rec["groups"]:
                g = dict(g)
                g["params"] = [index[f] for f in g["params"]]
                groups.append(g)
            old = {"state": opt.state, "param_groups": opt.param_groups}
            install_optimizer_hooks(opt)  # a torch optimizer has state now, before its first step
            opt.load_state_dict({"state": state, "param_groups": groups})
            done.append((opt, old))
            lock_layouts(params)
    except Exception as e:
        for opt, old in done:
            opt.__setstate__(old)
        raise CheckpointError(f"checkpoint {path!r}: the optimizer state does not load: {e}") from e
    with torch.no_grad():
        model.load_state_dict(
            {k[len(prefix) :]: v for k, v in request.items() if k.startswith(prefix) and not k.startswith("optim.")}
        )
    _barrier()
    return meta["extra"] if meta else None


# ---------------------------------------------------------------------------------------------------------------
# consolidated optimizer state (export)
# ---------------------------------------------------------------------------------------------------------------


def get_full_optimizer_state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``opt.state_dict()`` as the same optimizer on the unsharded model would have it (a collective: call it on
    every rank): by its state schema, element-wise and per-block tensors (8-bit codes and scales) are gathered to
    their full shapes, per-block dicts (Shampoo's and SOAP's bands, a user's tiles) merged from the ranks that
    compute them. ``param_names`` in each group lists the params by model name. Load it into the unsharded model's
    optimizer with ``opt.load_state_dict`` (or into a sharded one at any world size: each rank takes its part)."""
    fqns = _opt_fqns(model, opt, 0)
    sd = _dcp_state_dict(opt)
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    groups_of = [g for g in opt.param_groups for _ in g["params"]]
    full_state = {}
    for i, (pid, p, fqn, group) in enumerate(zip(ids, _opt_params(opt), fqns, groups_of)):
        st = sd["state"].get(pid) or {}
        dicts = {k for k, v in st.items() if is_block_dict(_entry_kind(opt, p, group, k, v, repr(fqn)))}
        # a collective per param keeps the ranks in step; per-block dicts may be on some ranks only (the ranks that
        # compute a block), every other key is on every rank
        has = _gather_objects((sorted(k for k in st if k not in dicts), sorted(dicts)))
        keys = has[0][0]
        if any(h != keys for h, _ in has):
            raise RuntimeError(f"ranks disagree on the optimizer state keys of {fqn!r}: {[h for h, _ in has]}")
        out = {}
        for key in keys:
            v = st[key]
            if isinstance(v, torch.Tensor) and hasattr(v, "placements"):
                v = v.full_tensor()  # (a RaggedDTensor or a DTensor: a collective on its group)
            out[key] = _cpu(v)
        for key in sorted(set().union(*[set(d) for _, d in has])):
            merged = {}
            for part in _gather_objects({b: _cpu(block) for b, block in (st.get(key) or {}).items()}):
                merged.update(part)  # (under HSDP every replica holds the same blocks)
            out[key] = dict(sorted(merged.items()))
        if out:
            full_state[i] = out
    for g, start in zip(sd["param_groups"], group_starts(opt)):
        g["param_names"] = fqns[start : start + len(g["params"])]
    sd["state"] = full_state
    return sd


def _cpu(v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().clone()
    if isinstance(v, list | tuple):
        return type(v)(_cpu(t) for t in v)
    if isinstance(v, Mapping):
        return {k: _cpu(t) for k, t in v.items()}
    return v
