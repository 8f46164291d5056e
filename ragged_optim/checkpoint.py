"""Sharded checkpoints of a ``fully_shard`` model and its optimizers that load at any world size.

Format. A checkpoint is a folder written by ``torch.distributed.checkpoint`` (``dcp.save`` with a
``FileSystemWriter``: every rank writes its own file, in parallel) plus ``meta.pt`` (names, full shapes, param
groups, the caller's ``extra``) and a ``COMPLETE`` marker written last. Every ragged-sharded tensor is described to
DCP as a chunk of a *global 1-D tensor*: rank k's piece ``[lo, hi)`` of the flattened param is a
``ShardedTensor`` shard at offset ``lo`` of a tensor of ``numel`` elements (built with
``ShardedTensor._init_from_local_shards_and_global_metadata`` from the layout every rank knows, so no collective is
spent on metadata; ranks with an empty piece contribute no shard). Loading at another world size asks DCP for the
new ranges and DCP reads the overlapping parts of the saved chunks: resharding is DCP's chunk overlap logic.

Optimizer state, per param and key (see :func:`state_kind`):

- ``elem``: a tensor shaped like the param's local piece (AdamW moments, Muon momentum, 8-bit codes, Shampoo
  momentum and 1-D grafting/diagonal state): a 1-D chunk ``[lo, hi)`` of ``numel`` elements;
- ``block``: 8-bit scales, one per block of ``block_size`` (``*_scales`` keys of a group with ``block_size``): a
  chunk ``[lo / block_size, ceil(hi / block_size))`` of ``ceil(numel / block_size)``; the layout never cuts a block,
  so the blocks, and their scales, do not depend on the world size;
- ``bands``: Shampoo's per-band factor and root matrices (``state["bands"][k]``), saved whole under the band index
  by the rank that computes the band, and loaded by the rank that computes it under the new layout;
- ``replicated``: everything else (``step``, state of unsharded params): identical on every rank, saved once.

Atomicity: data goes to ``<path>.tmp-<id>``; after every rank has finished, rank 0 writes ``meta.pt``, then
``COMPLETE``, then renames the folder to ``<path>`` (an older checkpoint at ``<path>`` is moved aside first and
deleted after). A folder without ``COMPLETE`` is never loaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ragged_optim.sharding import shard_info

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
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded (incomplete, another model, another optimizer); the message says why."""


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


@contextlib.contextmanager
def _quiet_sharded_tensor():
    """DCP warns that ShardedTensor is deprecated each time it touches one; we use it on purpose (see the module
    doc), so keep the logs readable."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
        yield


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


# ---------------------------------------------------------------------------------------------------------------
# global 1-D chunks
# ---------------------------------------------------------------------------------------------------------------


def _chunked(local: torch.Tensor, ranges: list[tuple[int, int]], my_rank: int, numel: int, group):
    """``local`` (this rank's ``ranges[my_rank]`` of a 1-D tensor of ``numel`` elements) as a ShardedTensor."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = local.device.type
    shards_md, local_shards = [], []
    for r, (lo, hi) in enumerate(ranges):
        if hi <= lo:
            continue
        global_rank = dist.get_global_rank(group, r) if group is not None else r
        md = ShardMetadata(shard_offsets=[lo], shard_sizes=[hi - lo], placement=f"rank:{global_rank}/{device}")
        shards_md.append(md)
        if r == my_rank:
            local_shards.append(Shard(local.reshape(-1), md))
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False)
    meta = ShardedTensorMetadata(shards_metadata=shards_md, size=torch.Size([numel]), tensor_properties=props)
    with _quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, meta, process_group=group)


def _param_ranges(p: torch.Tensor) -> tuple[list[tuple[int, int]], int, Any]:
    info = shard_info(p)
    layout = info.unit.layout
    return [layout.local_range(r, info.index) for r in range(layout.world_size)], info.unit.rank, info.unit.group


def _block_ranges(ranges: list[tuple[int, int]], block_size: int) -> list[tuple[int, int]]:
    return [(lo // block_size, -(-hi // block_size)) if hi > lo else (0, 0) for lo, hi in ranges]


# ---------------------------------------------------------------------------------------------------------------
# naming
# ---------------------------------------------------------------------------------------------------------------


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(param) -> its name in ``model`` (tied params: the first name)."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    return names


def _full_shape(p: torch.Tensor) -> tuple[int, ...]:
    info = shard_info(p)
    return tuple(info.shape) if info is not None else tuple(p.shape)


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
                    f"{_full_shape(p)} is not a parameter of the model. Was the optimizer built before fully_shard "
                    "(on the params fully_shard replaced)? Build it after fully_shard, from model.parameters()"
                )
            out.append(names[id(p)])
    return out


def _group_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    for g in opt.param_groups:
        if any(q is p for q in g["params"]):
            return g
    raise KeyError("param not in optimizer")


# ---------------------------------------------------------------------------------------------------------------
# state classification
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
    if value.dim() >= 1 and value.shape == p.shape:
        return "elem"
    return "replicated"


def _bands_here(opt, p: torch.Tensor, group: dict) -> set[int]:
    """Bands of Shampoo param ``p`` that this rank computes under the current layout: the bands it holds whole,
    and the split bands it owns."""
    out = {k for k, _, _ in opt._local_bands(p, group)}
    info = shard_info(p)
    if info is not None:
        per = opt._band_geometry(p, group["max_preconditioner_dim"])[2]
        for ob in info.unit.layout.owned_blocks[info.index]:
            if ob.owner == info.unit.rank:
                out.add(ob.start // per)
    return out


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
# building the DCP state dict
# ---------------------------------------------------------------------------------------------------------------


def _model_entries(model: nn.Module) -> tuple[dict[str, Any], dict[str, tuple]]:
    sd, shapes = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if _is_dtensor(t):
            raise CheckpointError(
                f"model entry {name!r} is a torch DTensor (torch FSDP2); save_checkpoint handles ragged_optim."
                "fully_shard models. Use torch.distributed.checkpoint.state_dict for FSDP2"
            )
        info = shard_info(t)
        shapes[name] = (_full_shape(t), str(t.dtype))
        if info is not None:
            ranges, rank, group = _param_ranges(t)
            if info.numel:
                sd[f"model.{name}"] = _chunked(t.detach(), ranges, rank, info.numel, group)
        else:
            sd[f"model.{name}"] = t.detach()
    return sd, shapes


def _optim_entries(model, opt, which: int) -> tuple[dict[str, Any], dict]:
    """DCP entries of one optimizer's state, and its schema for meta.pt."""
    fqns = _opt_fqns(model, opt, which)
    sd: dict[str, Any] = {}
    schema: dict[str, dict[str, Any]] = {}
    for p, fqn in zip(_opt_params(opt), fqns):
        if _is_dtensor(p):
            raise CheckpointError(
                f"optimizer {which} param {fqn!r} is a torch DTensor; save_checkpoint handles ragged_optim."
                "fully_shard params and plain tensors"
            )
        state = opt.state.get(p)
        if not state:
            continue
        group = _group_of(opt, p)
        entry: dict[str, Any] = {}
        for key, v in state.items():
            kind = state_kind(p, key, v, group)
            base = f"optim.{which}.state.{fqn}.{key}"
            if kind == "object":
                entry[key] = ("object", v)
            elif kind == "bands":
                entry[key] = ("bands",)
                for k, band in v.items():
                    _flatten_band(f"{base}.{k}", band, sd)
            elif kind == "replicated":
                entry[key] = ("replicated",)
                sd[base] = v
            else:
                ranges, rank, pg = _param_ranges(p)
                numel = shard_info(p).numel
                if kind == "block":
                    bs = group["block_size"]
                    ranges, numel = _block_ranges(ranges, bs), -(-numel // bs)
                entry[key] = (kind, str(v.dtype))
                if numel:
                    sd[base] = _chunked(v, ranges, rank, numel, pg)
        schema[fqn] = entry
    groups = []
    saved = opt.state_dict()["param_groups"]
    k = 0
    for g in saved:
        g = dict(g)
        n = len(g["params"])
        g["params"] = fqns[k : k + n]
        k += n
        groups.append(g)
    return sd, {"class": type(opt).__name__, "fqns": fqns, "groups": groups, "state": schema}


# ---------------------------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
    extra: Any = None,
) -> str:
    """Save ``model`` (sharded with ``ragged_optim.fully_shard``, or plain) and ``optimizers`` to the folder
    ``path``; a collective: call it on every rank. ``extra`` (any picklable object, e.g. ``{"step": 100}``) is
    stored as rank 0 has it and returned by :func:`load_checkpoint`. Returns ``path``.

    The folder appears only once every rank has written its part (see the module doc); an existing checkpoint at
    ``path`` is replaced."""
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = (optimizers,)
    token = _broadcast_obj(uuid.uuid4().hex[:12] if _rank() == 0 else None)
    tmp = f"{path}.tmp-{token}"
    sd, shapes = _model_entries(model)
    schemas = []
    for j, opt in enumerate(optimizers):
        osd, schema = _optim_entries(model, opt, j)
        sd.update(osd)
        schemas.append(schema)
    if _rank() == 0:
        os.makedirs(tmp, exist_ok=True)
    _barrier()
    with _quiet_sharded_tensor():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    _barrier()  # every rank's data is on disk
    if _rank() == 0:
        world = dist.get_world_size() if _dist_on() else 1
        meta = {
            "version": FORMAT_VERSION,
            "world_size": world,
            "model": shapes,
            "optimizers": schemas,
            "extra": extra,
        }
        torch.save(meta, os.path.join(tmp, META_FILE))
        _write_marker(tmp, f"ragged-optim checkpoint v{FORMAT_VERSION}, world size {world}\n")
        _publish(tmp, path, token)
    _barrier()
    return path


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
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a checkpoint folder whose write finished (it has the ``COMPLETE`` marker)."""
    return os.path.isfile(os.path.join(os.fspath(path), COMPLETE_MARKER))


def _require_complete(path: str) -> None:
    if is_complete(path):
        return
    parent = os.path.dirname(os.path.abspath(path)) or "."
    base = os.path.basename(os.path.abspath(path))
    partial = sorted(d for d in os.listdir(parent) if d.startswith(base + ".tmp-")) if os.path.isdir(parent) else []
    if os.path.isdir(path):
        why = f"checkpoint {path!r} has no {COMPLETE_MARKER} marker: its write was interrupted (a rank died or "
        why += "ran out of disk before every rank finished); load an earlier checkpoint"
    elif partial:
        why = f"no checkpoint at {path!r}; an interrupted write left {partial} without a {COMPLETE_MARKER} marker "
        why += "(a rank died while saving); load an earlier checkpoint"
    else:
        why = f"no checkpoint at {path!r} (no such folder with a {COMPLETE_MARKER} marker)"
    raise CheckpointError(why)


# ---------------------------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------------------------


def _read_meta(path: str) -> dict:
    meta = torch.load(os.path.join(path, META_FILE), weights_only=False)
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path!r} has format version {meta.get('version')}, want {FORMAT_VERSION}")
    return meta


def _check_model(path: str, meta: dict, model: nn.Module) -> None:
    saved = meta["model"]
    own = {n: (_full_shape(t), str(t.dtype)) for n, t in model.state_dict(keep_vars=True).items()}
    missing = [n for n in own if n not in saved]
    unexpected = [n for n in saved if n not in own]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path!r} is from another model: the model has {missing[:4]} which the checkpoint lacks, "
            f"the checkpoint has {unexpected[:4]} which the model lacks. Build the model the checkpoint was saved "
            "from (same module names)"
        )
    for n, (shape, dtype) in own.items():
        s_shape, s_dtype = saved[n]
        if tuple(s_shape) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {path!r}: {n!r} has shape {tuple(s_shape)} in the checkpoint but {tuple(shape)} in the "
                "model; the checkpoint is from a differently shaped model (check the model config)"
            )
        if s_dtype != dtype:
            raise CheckpointError(
                f"checkpoint {path!r}: {n!r} is {s_dtype} in the checkpoint but {dtype} in the model; cast the model "
                "to the saved dtype before loading (or load the full state dict and cast)"
            )


def _check_optimizer(path: str, meta_opt: dict, model, opt, which: int) -> list[str]:
    fqns = _opt_fqns(model, opt, which)
    if meta_opt["class"] != type(opt).__name__:
        raise CheckpointError(
            f"checkpoint {path!r}: optimizer {which} was a {meta_opt['class']} but is a {type(opt).__name__} now; "
            "pass the optimizers in the order they were saved"
        )
    sizes = [len(g["params"]) for g in opt.param_groups]
    saved_sizes = [len(g["params"]) for g in meta_opt["groups"]]
    if sizes != saved_sizes or fqns != meta_opt["fqns"]:
        diff = sorted(set(fqns) ^ set(meta_opt["fqns"]))
        raise CheckpointError(
            f"checkpoint {path!r}: optimizer {which} ({type(opt).__name__}) holds other params than the saved one "
            f"(group sizes {sizes} vs saved {saved_sizes}; params in only one of them: {diff[:4]}). Build the "
            "optimizer with the same param groups, in the same order, as when it was saved"
        )
    return fqns


def _local_template(p, kind: str, dtype, group, ranges, rank, numel):
    if kind == "block":
        bs = group["block_size"]
        ranges, numel = _block_ranges(ranges, bs), -(-numel // bs)
    lo, hi = ranges[rank]
    return torch.empty(hi - lo, dtype=dtype, device=p.device), ranges, numel


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
) -> Any:
    """Load a checkpoint of :func:`save_checkpoint` into ``model`` and ``optimizers`` at the current world size
    and layouts (any world size: pieces are resharded); a collective: call it on every rank after building the
    optimizers. Returns the saved ``extra``. Raises :class:`CheckpointError` for an incomplete checkpoint, another
    model or other optimizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from ragged_optim.optim.base import lock_layouts

    path = os.fspath(path)
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = (optimizers,)
    _require_complete(path)
    meta = _read_meta(path)
    _check_model(path, meta, model)
    if len(optimizers) != len(meta["optimizers"]):
        raise CheckpointError(
            f"checkpoint {path!r} holds {len(meta['optimizers'])} optimizers, {len(optimizers)} were given; pass "
            "the same optimizers, in the same order, as to save_checkpoint"
        )
    reader = dcp.FileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    request, _ = _model_entries(model)
    plans = []
    for j, (opt, m) in enumerate(zip(optimizers, meta["optimizers"])):
        fqns = _check_optimizer(path, m, model, opt, j)
        plan = {}
        for p, fqn in zip(_opt_params(opt), fqns):
            entry = m["state"].get(fqn)
            if not entry:
                continue
            group = _group_of(opt, p)
            pst: dict[str, Any] = {}
            for key, spec in entry.items():
                base = f"optim.{j}.state.{fqn}.{key}"
                kind = spec[0]
                if kind == "object":
                    pst[key] = spec[1]
                elif kind == "replicated":
                    md = stored[base]
                    request[base] = torch.empty(md.size, dtype=md.properties.dtype, device=p.device)
                    pst[key] = request[base]
                elif kind == "bands":
                    bands = {}
                    for k in sorted(_bands_here(opt, p, group)):
                        prefix = f"{base}.{k}."
                        names = [s for s in stored if s.startswith(prefix)]
                        if not names:
                            continue  # the band was never computed (no grad yet)
                        entries = {}
                        for s in names:
                            md = stored[s]
                            request[s] = torch.empty(md.size, dtype=md.properties.dtype, device=p.device)
                            entries[s[len(prefix) :]] = request[s]
                        bands[k] = entries
                    pst[key] = ("bands", bands)
                else:
                    dtype = getattr(torch, spec[1].removeprefix("torch."))
                    if shard_info(p) is None:
                        raise CheckpointError(f"checkpoint {path!r}: {fqn!r} was sharded when saved but is not now")
                    ranges, rank, pg = _param_ranges(p)
                    local, ranges, numel = _local_template(p, kind, dtype, group, ranges, rank, shard_info(p).numel)
                    if numel:
                        request[base] = _chunked(local, ranges, rank, numel, pg)
                    pst[key] = local
            plan[fqn] = pst
        plans.append(plan)
    try:
        with _quiet_sharded_tensor():
            dcp.load(request, storage_reader=reader)
    except Exception as e:  # DCP reports a missing key or a size mismatch in its own words; add ours
        raise CheckpointError(f"checkpoint {path!r}: loading failed: {e}") from e
    # The model: ShardedTensor entries were filled in place (they wrap the params' storage); plain ones were not.
    with torch.no_grad():
        own = model.state_dict(keep_vars=True)
        for name, t in own.items():
            v = request.get(f"model.{name}")
            if isinstance(v, torch.Tensor) and not isinstance(v, ShardedTensor) and v is not t:
                t.copy_(v)
    for opt, m, plan in zip(optimizers, meta["optimizers"], plans):
        params = _opt_params(opt)
        index = {fqn: i for i, fqn in enumerate(m["fqns"])}
        state = {}
        for fqn, pst in plan.items():
            out = {}
            for key, v in pst.items():
                if isinstance(v, tuple) and v and v[0] == "bands":
                    out[key] = {k: _unflatten_band(entries) for k, entries in v[1].items()}
                else:
                    out[key] = v
            state[index[fqn]] = out
        groups = []
        for g in m["groups"]:
            g = dict(g)
            g["params"] = [index[f] for f in g["params"]]
            groups.append(g)
        opt.load_state_dict({"state": state, "param_groups": groups})
        lock_layouts(params)
    _barrier()
    return meta["extra"]


# ---------------------------------------------------------------------------------------------------------------
# consolidated optimizer state (export)
# ---------------------------------------------------------------------------------------------------------------


def _gather_objects(obj) -> list:
    if not _dist_on():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def get_full_optimizer_state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``opt.state_dict()`` as the same optimizer on the unsharded model would have it (a collective: call it on
    every rank): element-wise state is gathered to full shape (8-bit codes stay flat, as the one-process optimizer
    keeps them), 8-bit scales and Shampoo bands are merged from their ranks. ``param_names`` in each group lists
    the params by model name. Load it into the unsharded model's optimizer with ``opt.load_state_dict``."""
    fqns = _opt_fqns(model, opt, 0)
    sd = opt.state_dict()
    full_state = {}
    for i, (p, fqn) in enumerate(zip(_opt_params(opt), fqns)):
        state = opt.state.get(p) or {}
        has = _gather_objects(sorted(state))  # a collective per param keeps every rank in step
        if not any(has):
            continue
        if any(h != has[0] for h in has):
            raise RuntimeError(f"ranks disagree on the optimizer state keys of {fqn!r}: {has}")
        group = _group_of(opt, p)
        info = shard_info(p)
        out = {}
        for key in has[0]:
            v = state[key]
            kind = state_kind(p, key, v, group)
            if kind in ("object", "replicated"):
                out[key] = v.detach().clone().cpu() if isinstance(v, torch.Tensor) else v
            elif kind == "bands":
                merged = {}
                for part in _gather_objects({k: {n: _cpu(t) for n, t in b.items()} for k, b in v.items()}):
                    merged.update(part)
                out[key] = dict(sorted(merged.items()))
            elif kind == "elem":
                full = info.unit.gather_full(info.index, v.detach()).reshape(-1).cpu()
                out[key] = full if key.endswith("_codes") else full.reshape(info.shape)
            else:  # block
                lo, _ = info.local_range
                parts = _gather_objects((lo // group["block_size"], v.detach().cpu()))
                out[key] = torch.cat([t for _, t in sorted(parts, key=lambda x: x[0]) if t.numel()])
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
            for key, v in (st or {}).items():
                if not isinstance(v, torch.Tensor) or v.dim() == 0 or key.endswith("_scales"):
                    continue
                if v.numel() != p.numel():
                    names = g.get("param_names")
                    named = f" ({names[i]!r})" if names else ""
                    raise ValueError(
                        f"{type(opt).__name__}.load_state_dict: state {key!r} of param_groups[{gi}]['params'][{i}]"
                        f"{named} has {v.numel()} elements but the param has {p.numel()} here (full shape "
                        f"{_full_shape(p)}): the state dict is from another model, world size or layout. Use "
                        "ragged_optim.checkpoint.save_checkpoint/load_checkpoint to move state across world sizes"
                    )
