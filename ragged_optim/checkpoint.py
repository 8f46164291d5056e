"""Sharded checkpoints of a model (``ragged_optim.fully_shard``, torch FSDP2 or plain) and its optimizers, in
torch's own distributed-checkpoint (DCP) format, that load at any world size.

Format (version 2). A checkpoint is a folder written by ``torch.distributed.checkpoint`` (every rank writes its own
file, in parallel) plus ``meta.pt`` (format version, optimizer classes, param groups by name, the caller's
``extra``) and a ``COMPLETE`` marker written last. The DCP keys are the ones torch's
``dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)})`` writes:

- ``model.<name>``: every entry of ``model.state_dict()`` under its original name and full shape (a ragged param
  is written as the rectangular chunks of its ranks' pieces, see :mod:`ragged_optim.sharding.ragged_dtensor`), so
  ``dcp_to_torch_save``, a plain model and a torch FSDP2 model read it as they read their own;
- ``optim.state.<name>.<key>``: optimizer state of param ``<name>``. State laid out like the param
  (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, Shampoo ``momentum``, 8-bit ``*_codes``) has the param's full
  shape; 8-bit ``*_scales`` (one fp32 per block of ``block_size`` elements of the flattened param) have shape
  ``[ceil(numel / block_size)]``; ``step`` and the state of unsharded params are stored once;
- ``optim.state.<name>.bands.<k>.<field>[.<i>]``: Shampoo's band ``k`` (rows ``[k*B, (k+1)*B)`` of the matrix view,
  ``B = max_preconditioner_dim``): ``L``, ``R``, ``L_root``, ``R_root`` (list entries ``i``: one stack of tiles per
  tile width) and ``graft``, written by the rank that computes the band; on load each band is read by the rank
  that computes it under the new layout;
- ``optim.param_groups.<g>.<key>``: the hyperparameters and (``params``) the param names of each group, as torch
  writes them.

Every rank contributes its own keys to DCP's metadata, so no state is dropped at any setting. Several optimizers
share the ``optim.state`` namespace (each param belongs to one); ``meta.pt`` says which groups are whose.

Loading reads everything into fresh buffers first, checks every key and shape before that, and only after the read
succeeded writes the optimizers (each restored on failure) and then the model: a failed load changes nothing.
Every failure to read a checkpoint is a :class:`CheckpointError` naming the folder or file and the cause.
``load_checkpoint`` also reads a plain torch DCP checkpoint of a model (``dcp.save(get_model_state_dict(m))`` or
``dcp.save({"model": ...})``): model state only.

Atomicity: data goes to ``<path>.tmp-<id>``; after every rank has finished, rank 0 writes ``meta.pt``, then
``COMPLETE``, then renames the folder to ``<path>`` (an older checkpoint at ``<path>`` is moved aside first and
deleted after). A folder of ours without ``COMPLETE`` is never loaded. If a save dies between those two renames,
``load_checkpoint(path)`` loads the complete checkpoint it left (``<path>.tmp-<id>``, else ``<path>.old-<id>``) with a
warning, and the next successful save removes such leftovers.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ragged_optim.optim.blocks import BlockOptimizer
from ragged_optim.sharding import shard_info
from ragged_optim.sharding.ragged_dtensor import RaggedDTensor
from ragged_optim.sharding.sharded_param import full_shape, local_of
from ragged_optim.sharding.state_dict import (
    _block_ranges,
    _ranges,
    install_optimizer_hooks,
    optimizer_state_to_dcp,
    per_element_state,
    sharded_dtensor,
)

__all__ = [
    "COMPLETE_MARKER",
    "CheckpointError",
    "check_optimizer_state_dict",
    "get_full_optimizer_state_dict",
    "is_complete",
    "load_checkpoint",
    "save_checkpoint",
    "state_kind",
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
# state classification (also used by the consolidated export below)
# ---------------------------------------------------------------------------------------------------------------


def state_kind(p: torch.Tensor, key: str, value: Any, group: dict) -> str:
    """How optimizer state ``value`` under ``key`` of param ``p`` is laid out: ``"elem"``, ``"block"``,
    ``"bands"``, ``"replicated"`` or ``"object"`` (not a tensor: kept as is)."""
    if key == "bands" and isinstance(value, dict):
        return "bands"
    if not isinstance(value, torch.Tensor):
        return "object"
    if shard_info(p) is None:
        return "replicated"
    if key.endswith("_scales") and "block_size" in group:
        return "block"
    if isinstance(value, RaggedDTensor) or (value.dim() >= 1 and value.shape == p.to_local().shape):
        return "elem"  # (a torch optimizer's state of a ragged param is a RaggedDTensor, like the param)
    return "replicated"


def _bands_here(opt, p: torch.Tensor, group: dict) -> set[int] | None:
    """Bands (blocks) of param ``p`` whose state this rank keeps under the current layout (Shampoo's and SOAP's
    ``bands`` are keyed by block index): the blocks it holds whole and the cut blocks it owns. None: not known (an
    optimizer that is no BlockOptimizer, or a param without blocks)."""
    from ragged_optim.optim.blocks import BlockOptimizer

    if not isinstance(opt, BlockOptimizer) or opt.block_spec(p, group) is None:
        return None
    return set(opt.blocks_computed_here(p))


def _flatten_band(prefix: str, band: dict, out: dict) -> None:
    for name, v in band.items():
        if isinstance(v, list | tuple):
            for i, t in enumerate(v):
                out[f"{prefix}.{name}.{i}"] = t
        else:
            out[f"{prefix}.{name}"] = v


def _unflatten_band(entries: dict[str, torch.Tensor]) -> dict:
    band: dict[str, Any] = {}
    lists: dict[str, dict[int, torch.Tensor]] = {}
    for rest, t in entries.items():
        name, _, idx = rest.rpartition(".")
        if name and idx.isdigit():
            lists.setdefault(name, {})[int(idx)] = t
        else:
            band[rest] = t
    for name, items in lists.items():
        band[name] = [items[i] for i in sorted(items)]
    return band


# ---------------------------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------------------------


def _optim_entries(model, opt, which: int, sd: dict, group_offset: int) -> dict:
    """Add one optimizer's DCP entries to ``sd``; return its record for meta.pt."""
    fqns = _opt_fqns(model, opt, which)
    for p, fqn in zip(_opt_params(opt), fqns):
        if _is_dtensor(p) and opt.state.get(p):
            raise CheckpointError(
                f"optimizer {which} ({type(opt).__name__}) param {fqn!r} is a torch DTensor (FSDP2); save_checkpoint "
                "saves optimizers of ragged_optim.fully_shard and plain params. For FSDP2 use "
                "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict with dcp.save"
            )
    osd = optimizer_state_to_dcp(opt, opt.state_dict())
    ids = [i for g in osd["param_groups"] for i in g["params"]]
    for pid, fqn in zip(ids, fqns):
        for key, v in (osd["state"].get(pid) or {}).items():
            base = f"optim.state.{fqn}.{key}"
            if key == "bands" and isinstance(v, dict):
                for k, band in v.items():
                    _flatten_band(f"{base}.{k}", band, sd)
            else:
                sd[base] = v
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
    return {"class": type(opt).__name__, "fqns": fqns, "groups": groups}


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
    rank and leaves any older checkpoint at ``path`` as it was."""
    import torch.distributed.checkpoint as dcp

    optimizers = _check_arguments("save_checkpoint", model, optimizers)
    path = _as_path(path, "save_checkpoint")
    _same_path_everywhere(path, "save_checkpoint")
    token = _broadcast_obj(uuid.uuid4().hex[:12] if _rank() == 0 else None)
    tmp = f"{path}.tmp-{token}"
    sd: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    records, offset = [], 0
    for j, opt in enumerate(optimizers):
        records.append(_optim_entries(model, opt, j, sd, offset))
        offset += len(opt.param_groups)
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
    for leftover in _siblings(path, ".old-") + [f for f in _siblings(path, ".tmp-") if is_complete(f)]:
        shutil.rmtree(leftover, ignore_errors=True)  # a crashed publish's (an unfinished .tmp- may be in flight)


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
                f"loading the complete checkpoint it left, {folder!r} (the next save to {path!r} removes it)",
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


def _optim_request(path, opt, p, fqn: str, group: dict, stored: dict, request: dict, claimed: list) -> dict:
    """Fresh buffers for the saved state of ``p`` this rank needs; returns ``{key: buffer or ('bands', {...})}``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    base = f"optim.state.{fqn}."
    info = shard_info(p)
    out: dict[str, Any] = {}
    band_keys: dict[int, list[str]] = {}
    for key, md in stored.items():
        if not key.startswith(base):
            continue
        rest = key[len(base) :]
        if rest.startswith("bands."):
            k = rest.split(".")[1]
            if k.isdigit():
                band_keys.setdefault(int(k), []).append(key)
                continue
        if not isinstance(md, TensorStorageMetadata):
            request[key] = None
            out[rest] = key
            continue
        dtype, size = md.properties.dtype, tuple(md.size)
        bs = group.get("block_size")
        if info is not None and rest.endswith("_scales") and bs and size == (-(-info.numel // bs),):
            lo, hi = _block_ranges(_ranges(info), bs)[info.unit.rank]
            request[key] = sharded_dtensor(torch.empty(hi - lo, dtype=dtype, device=p.device), info, block_size=bs)
        elif info is not None and per_element_state(rest, size, info.shape):
            request[key] = sharded_dtensor(torch.empty(p.to_local().numel(), dtype=dtype, device=p.device), info)
        else:  # a step counter stays on the CPU, as the optimizers keep it (on a GPU: no sync per read)
            device = "cpu" if rest == "step" and size == () else p.device
            request[key] = torch.empty(size, dtype=dtype, device=device)
        out[rest] = key
    if band_keys:
        mine = _bands_here(opt, p, group)
        mine = set(band_keys) if mine is None else mine
        bands = {}
        for k in sorted(set(band_keys) & mine):
            entries = {}
            for key in band_keys[k]:
                md = stored[key]
                request[key] = torch.empty(md.size, dtype=md.properties.dtype, device=p.device)
                entries[key[len(f"{base}bands.{k}.") :]] = key
            bands[k] = entries
            claimed.append((fqn, k))
        out["bands"] = ("bands", bands, sorted(band_keys))
    return out


def _local_value(v, p):
    if isinstance(v, RaggedDTensor):
        return v.to_local()
    if isinstance(v, torch.Tensor) and shard_info(p) is None and v.dim() > 0 and not torch.is_floating_point(v):
        return v.reshape(-1)  # 8-bit codes of an unsharded param are flat (one per element)
    return v


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
) -> Any:
    """Load a checkpoint of :func:`save_checkpoint` (or a torch DCP checkpoint of a model: model state only) into
    ``model`` and ``optimizers`` at the current world size and layouts (any world size: pieces are resharded); a
    collective: call it on every rank after building the optimizers. Returns the saved ``extra`` (None for a torch
    checkpoint). All or nothing: every check runs and every tensor is read before anything is written. Raises
    :class:`CheckpointError` for an incomplete or corrupt checkpoint, another model or other optimizers."""
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
        if len(optimizers) != len(meta["optimizers"]):
            raise CheckpointError(
                f"checkpoint {path!r} holds {len(meta['optimizers'])} optimizers, {len(optimizers)} were given; pass "
                "the same optimizers, in the same order, as to save_checkpoint"
            )
    request = _model_request(path, model, stored, prefix)
    plans, claimed, problem = [], [], None
    for j, opt in enumerate(optimizers):
        rec = meta["optimizers"][j]
        fqns = _check_optimizer(path, rec, model, opt, j)
        plans.append(
            {
                fqn: _optim_request(path, opt, p, fqn, _group_of(opt, p), stored, request, claimed)
                for p, fqn in zip(_opt_params(opt), fqns)
            }
        )
    # Every saved Shampoo band must be read by the rank that computes it now: otherwise its state would be lost.
    all_claimed = set().union(*[set(c) for c in _gather_objects(claimed)])
    for plan in plans:
        for fqn, pst in plan.items():
            spec = pst.get("bands")
            if spec is not None:
                lost = [k for k in spec[2] if (fqn, k) not in all_claimed]
                if lost and problem is None:
                    problem = (
                        f"checkpoint {path!r}: bands {lost[:4]} of {fqn!r} would be read by no rank under "
                        "the current layout (another max_preconditioner_dim?)"
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
                p = params[index[fqn]]
                st = {}
                for key, v in pst.items():
                    if isinstance(v, tuple) and v and v[0] == "bands":
                        st[key] = {
                            k: _unflatten_band({n: request[full] for n, full in entries.items()})
                            for k, entries in v[1].items()
                        }
                    else:
                        st[key] = _local_value(request[v], p)
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
    every rank): element-wise state is gathered to full shape (8-bit codes too, as the one-process AdamW8bit's
    state_dict shows them), 8-bit scales and Shampoo bands are merged from their ranks. ``param_names`` in each
    group lists the params by model name. Load it into the unsharded model's optimizer with ``opt.load_state_dict``."""
    fqns = _opt_fqns(model, opt, 0)
    sd = opt.state_dict()
    full_state = {}
    for i, (p, fqn) in enumerate(zip(_opt_params(opt), fqns)):
        state = opt.state.get(p) or {}
        has = _gather_objects(sorted(state))  # a collective per param keeps every rank in step
        if not any(has):
            continue
        # Shampoo's "bands" exist only on ranks that compute a band; every other key is on every rank
        keys = sorted(set().union(*has))
        if any(set(h) - {"bands"} != set(keys) - {"bands"} for h in has):
            raise RuntimeError(f"ranks disagree on the optimizer state keys of {fqn!r}: {has}")
        group = _group_of(opt, p)
        info = shard_info(p)
        out = {}
        for key in keys:
            v = state.get(key, {})
            kind = state_kind(p, key, v, group)
            if kind in ("object", "replicated"):
                out[key] = v.detach().clone().cpu() if isinstance(v, torch.Tensor) else v
            elif kind == "bands":
                merged = {}
                for part in _gather_objects({k: {n: _cpu(t) for n, t in b.items()} for k, b in v.items()}):
                    merged.update(part)
                out[key] = dict(sorted(merged.items()))
            elif kind == "elem":
                out[key] = info.unit.gather_full(info.index, local_of(v).detach()).reshape(info.shape).cpu()
            else:  # block
                lo, _ = info.local_range
                parts = _gather_objects((lo // group["block_size"], v.detach().cpu()))
                # by first block: under HSDP every replica holds the same blocks (the world gathers each once per
                # replica: before, the scales came out once per replica)
                out[key] = torch.cat([t for _, t in sorted({b: t for b, t in parts if t.numel()}.items())])
        full_state[i] = out
    for g, start in zip(sd["param_groups"], _starts(opt)):
        g["param_names"] = fqns[start : start + len(g["params"])]
    sd["state"] = full_state
    return sd


def _cpu(v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().clone()
    if isinstance(v, list | tuple):
        return type(v)(_cpu(t) for t in v)
    return v


def _starts(opt) -> list[int]:
    out, k = [], 0
    for g in opt.param_groups:
        out.append(k)
        k += len(g["params"])
    return out


# ---------------------------------------------------------------------------------------------------------------
# plain optimizer.load_state_dict guard
# ---------------------------------------------------------------------------------------------------------------


def check_optimizer_state_dict(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Raise a ValueError naming the param when ``state_dict`` (for ``opt.load_state_dict``) was saved for other
    params: element-wise state whose size differs from the param's local piece (another model, or the same model
    at another world size or layout). torch itself checks only the group sizes."""
    groups = state_dict.get("param_groups", [])
    saved_sizes = [len(g["params"]) for g in groups]
    sizes = [len(g["params"]) for g in opt.param_groups]
    if saved_sizes != sizes:
        raise ValueError(
            f"{type(opt).__name__}.load_state_dict: the state dict has param groups of sizes {saved_sizes}, the "
            f"optimizer {sizes}: it was saved for another model or other param groups"
        )
    ids = [i for g in groups for i in g["params"]]
    starts = _starts(opt)
    for gi, g in enumerate(opt.param_groups):
        for i, p in enumerate(g["params"]):
            st = state_dict.get("state", {}).get(ids[starts[gi] + i])
            fsdp2 = isinstance(p, DTensor) and shard_info(p) is None
            # an FSDP2 param's state is its local rows (8-bit codes: its blocks, which AdamW8bit checks itself)
            here = p.to_local().numel() if fsdp2 or shard_info(p) is not None else p.numel()
            for key, v in (st or {}).items():
                if not isinstance(v, torch.Tensor) or v.dim() == 0 or key.endswith("_scales"):
                    continue
                if fsdp2 and key.endswith("_codes"):
                    continue
                if v.numel() != here:
                    names = g.get("param_names")
                    named = f" ({names[i]!r})" if names else ""
                    raise ValueError(
                        f"{type(opt).__name__}.load_state_dict: state {key!r} of param_groups[{gi}]['params'][{i}]"
                        f"{named} has {v.numel()} elements but the param has {here} here (full shape "
                        f"{tuple(full_shape(p))}): the state dict is from another model, world size or layout. Use "
                        "ragged_optim.checkpoint.save_checkpoint/load_checkpoint to move state across world sizes"
                    )
