"""`ragged-optim plan`: plan every FSDP unit of a model and report padding, split blocks and balance.

Block specs from ``--optimizer`` and ``--granularity G``:

- without ``--optimizer``: bands of G rows for matrices, runs of G elements for 1-D tensors;
- ``adamw8bit``: runs of G elements of every tensor (8-bit Adam quantization blocks);
- ``shampoo``, ``soap``: bands of G rows (Shampoo's B x B tiles and SOAP's eigenbases live inside a band);
- ``muon``: hidden matrices (ndim >= 2, not an embedding, head or bias) are whole owner-computed matrices,
  everything else runs of G elements.

``fsdp2_padding_ratio`` models FSDP2's ``Shard(0)`` for the same constraint, per parameter: dim 0 is padded to a
multiple of ``W * G`` (``torch.chunk`` pads to ``ceil(d0 / W)`` rows per rank, and keeping G-row blocks whole on a
rank needs a multiple of G rows per rank). For 3-D expert stacks dim 0 is the expert index (every slice is whole
matrices), so it is padded to a multiple of W; owner-computed (Muon) matrices likewise take only ``Shard(0)`` padding.
Where one block is a whole tensor (G >= its rows or elements), FSDP2 cannot keep it whole on a rank without
holding it on every rank: a matrix is then charged only ``Shard(0)`` padding (a multiple of W rows, the lenient
choice), a 1-D tensor ``W`` times its length (a multiple of ``W * G`` elements, capped at its length).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ragged_optim.sharding.layout import BlockSpec

# The planner and the catalog are imported where a plan runs: the sharding package imports torch, and
# `ragged-optim plan --help` needs none.

OPTIMIZERS = ("muon", "shampoo", "soap", "adamw8bit")

#: Tensor parallel as torchtitan and Megatron split a transformer (``--tp``): column-wise (dim 0 / tp) for the
#: projections into a wider space and the vocab-parallel embedding and head; row-wise (dim 1 / tp) for those back;
#: everything else (norms, routers, fused expert stacks: no expert TP) replicated over tp.
TP_COLWISE = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "qkv_proj", "fc1",
              "w1", "w3", "lm_head", "embed_tokens")  # fmt: skip
TP_ROWWISE = ("o_proj", "down_proj", "fc2", "w2")


def model_names() -> list[str]:
    from ragged_optim.sharding.catalog import model_names as names

    return names()


def _model_names_for_help() -> list[str]:
    """The catalog's model names for ``--help``, without torch: sharding/catalog.py is plain Python that imports
    nothing of ours, but importing it as ``ragged_optim.sharding.catalog`` runs the sharding package, which
    imports torch. So it is loaded from its file on its own (under a private name), once."""
    name = "_ragged_optim_catalog_for_help"
    module = sys.modules.get(name)
    if module is None:
        package = importlib.util.find_spec("ragged_optim.sharding")  # where it is; its __init__ does not run
        path = os.path.join(package.submodule_search_locations[0], "catalog.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # (dataclasses look their module up while the file runs)
        spec.loader.exec_module(module)
    return module.model_names()


def _is_hidden_matrix(name: str, shape) -> bool:
    low = name.lower()
    return len(shape) >= 2 and "embed" not in low and "lm_head" not in low and not low.endswith("bias")


def block_spec(name: str, shape, g: int, optimizer: str | None) -> BlockSpec:
    from ragged_optim.sharding.layout import BlockSpec

    numel = math.prod(shape)
    if optimizer == "muon":
        if _is_hidden_matrix(name, shape):
            return BlockSpec.matrices(shape)
        return BlockSpec.elements(g, numel)
    if optimizer == "adamw8bit":
        return BlockSpec.elements(g, numel)
    return BlockSpec.rows(g, shape)


def fsdp2_padded(shape, spec: BlockSpec, world_size: int) -> int:
    """Elements FSDP2 Shard(0) would allocate for one parameter under the same block constraint."""
    if not shape:
        return world_size  # a scalar: one element per rank
    d0, rest = shape[0], math.prod(shape[1:])
    if spec.owner_computed or len(shape) >= 3:
        mult = world_size
    elif len(shape) == 2 and spec.block < spec.period and spec.block % max(1, shape[1]) == 0:
        mult = world_size * (spec.block // shape[1])  # G-row bands
    elif len(shape) == 2 and spec.block >= spec.period:
        mult = world_size
    elif len(shape) == 2:
        mult = world_size * math.lcm(spec.block, rest) // rest  # element runs across rows
    else:
        mult = world_size * spec.block
    return -(-d0 // mult) * mult * rest


def _load_module(spec: str):
    """Build the module that ``--module pkg.mod:factory`` names, on the meta device."""
    mod_name, _, factory = spec.partition(":")
    if not mod_name or not factory:
        raise ValueError(f"--module must look like pkg.mod:factory, got {spec!r}")
    import torch
    import torch.nn as nn

    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does: modules of the current folder
        sys.path.insert(0, os.getcwd())
    fn = getattr(importlib.import_module(mod_name), factory)
    if not callable(fn):
        raise ValueError(
            f"--module {spec}: {factory} is a {type(fn).__name__}, not a callable; "
            "name a function or class that takes no arguments and returns a torch.nn.Module"
        )
    try:
        with torch.device("meta"):
            module = fn()
    except Exception as e:  # the user's factory: report it as bad input, not a traceback from our CLI
        raise ValueError(
            f"--module {spec}: calling {factory}() failed with {type(e).__name__}: {e}; "
            "the factory must take no arguments and build the model"
        ) from e
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"--module {spec}: {factory}() returned a {type(module).__name__}, not a torch.nn.Module; "
            "name a function or class that builds the model"
        )
    return module


def _units_of(model) -> tuple[str, list]:
    from ragged_optim.sharding.catalog import model_units, units_from_module

    if isinstance(model, str):
        return model, model_units(model)  # an unknown name: a ValueError listing the known ones
    import torch.nn as nn

    if isinstance(model, nn.Module):
        return type(model).__name__, units_from_module(model)
    raise ValueError(
        f"model must be a catalog model name ({', '.join(model_names())}) or a torch.nn.Module "
        f"(build large ones on the meta device), got {type(model).__name__}"
    )


def _tp_split_dim(name: str, shape) -> int | None:
    """The dim tensor parallel splits ``name`` along (None: replicated over tp), by TP_COLWISE / TP_ROWWISE."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else parts[-1]
    if len(shape) >= 3:  # fused expert stacks: expert parallel's, not TP's
        return None
    if module in TP_COLWISE:
        return 0
    if module in TP_ROWWISE and len(shape) == 2 and parts[-1] == "weight":
        return 1
    return None


def parallel_units(units, world_size: int, tp: int = 1, ep: int = 1) -> list[tuple]:
    """``(unit, ranks)`` to plan under tensor and expert parallel: each unit's TP-local shapes over the
    ``world_size // tp`` data-parallel ranks; with ``ep``, each unit's fused expert stacks (3-D ``[E, out, in]``)
    as a unit of their own (``NAME.experts``) holding ``E // ep`` experts, over the ``world_size // ep`` ranks that
    hold the same experts (the dense rest over every data-parallel rank)."""
    from ragged_optim.sharding.catalog import Unit

    for value, flag in ((tp, "tp"), (ep, "ep")):
        if not isinstance(value, int) or value < 1 or world_size % value:
            raise ValueError(f"{flag} must be an int >= 1 that divides world_size={world_size}, got {value!r}")
    if tp > 1 and ep > 1:
        raise ValueError("planning tensor and expert parallel together is not modelled: pass --tp or --ep")
    out = []
    for unit in units:
        dense, experts = [], []
        for name, shape in unit.params:
            shape = tuple(shape)
            if ep > 1 and len(shape) >= 3:
                if shape[0] % ep:
                    raise ValueError(f"{name}: {shape[0]} experts do not divide over ep={ep} ranks")
                experts.append((name, (shape[0] // ep, *shape[1:])))
                continue
            dim = _tp_split_dim(name, shape) if tp > 1 else None
            if dim is not None:
                if shape[dim] % tp:
                    raise ValueError(f"{name}: dim {dim} of {shape} does not divide over tp={tp} ranks")
                shape = tuple(d // tp if k == dim else d for k, d in enumerate(shape))
            dense.append((name, shape))
        if dense:
            out.append((Unit(unit.name, tuple(dense)), world_size // tp))
        if experts:
            out.append((Unit(f"{unit.name}.experts", tuple(experts)), world_size // ep))
    return out


def plan_model(
    model,
    world_size: int,
    *,
    tp: int = 1,
    ep: int = 1,
    granularity: int = 1,
    optimizer: str | None = None,
    allow_split: bool = True,
    itemsize: int = 4,
    alignment: int = 16,
    return_layouts: bool = False,
) -> dict:
    """Plan every FSDP unit of ``model`` at ``world_size`` ranks, as ``ragged-optim plan`` does; the Python entry.

    ``model``: a catalog name (``ragged_optim.sharding.catalog.model_names()``) or an ``nn.Module`` (only shapes
    are read: build a large one on the meta device). ``tp`` / ``ep``: tensor / expert parallel sizes
    (:func:`parallel_units`): units are planned at their TP-local shapes over ``world_size // tp`` ranks, expert
    stacks over ``world_size // ep``; balance figures are then the worst of the two rank groups. Block specs come
    from ``optimizer`` and ``granularity`` (see the module doc). Owners of owner-computed blocks are balanced over
    all units of a rank group together, as the optimizers do.

    Returns the summary (the keys ``plan --json`` prints) plus ``"_rows"``: one dict per distinct unit, with
    ``count`` units behind it (``owner_moved_*`` and the owner compute balance over all of them: identical units get
    different owners); with ``return_layouts=True`` also ``"_units"``: ``(unit, layout)`` per unit, owners final.
    """
    import numpy as np

    from ragged_optim.sharding.planner import (
        TensorSpec,
        assign_owners_jointly,
        layout_stats,
        owner_compute_loads,
        plan_unit,
        rank_loads,
    )

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (the number of ranks), got {world_size!r}")
    if not isinstance(granularity, int) or granularity < 1:
        raise ValueError(f"granularity must be an int >= 1 (rows for matrices, elements for 1-D), got {granularity!r}")
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be None or one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    name, units = _units_of(model)
    planned = parallel_units(units, world_size, tp, ep)
    units = [u for u, _ in planned]
    g = granularity
    t_plan = 0.0
    layouts, unit_tensors, unit_seconds = [], [], []
    for unit, ranks in planned:
        tensors = [TensorSpec(n, tuple(s), itemsize, block_spec(n, s, g, optimizer)) for n, s in unit.params]
        t0 = time.perf_counter()
        layouts.append(plan_unit(tensors, ranks, alignment=alignment, allow_split=allow_split))
        unit_seconds.append(time.perf_counter() - t0)
        unit_tensors.append(tensors)
    # Owners of all units balanced together, largest matrix first, as the optimizers do (one step computes them all),
    # within each group of ranks (the expert units' and the dense ones' under expert parallel). The stats below
    # read these final owners: which matrices move depends on them.
    t0 = time.perf_counter()
    for ranks in sorted({r for _, r in planned}):
        idx = [k for k, (_, r) in enumerate(planned) if r == ranks]
        for k, layout in zip(idx, assign_owners_jointly([layouts[k] for k in idx])):
            layouts[k] = layout
    t_plan += sum(unit_seconds) + time.perf_counter() - t0
    sums = dict.fromkeys(
        ("total_elements", "padded_elements", "split_blocks", "split_elements", "owner_blocks", "owner_cut_blocks",
         "owner_moved_blocks", "owner_moved_elements", "fsdp2_padded"),
        0,
    )  # fmt: skip
    loads = {r: np.zeros(r, dtype=np.float64) for _, r in planned}  # per group of ranks
    comp = {r: np.zeros(r, dtype=np.float64) for _, r in planned}
    rows: dict[tuple, dict] = {}
    for unit, tensors, layout, dt in zip(units, unit_tensors, layouts, unit_seconds):
        W = layout.world_size
        st = layout_stats(layout)
        f2 = sum(fsdp2_padded(t.shape, t.spec, W) - math.prod(t.shape) for t in tensors)
        for k in sums:
            sums[k] += f2 if k == "fsdp2_padded" else st[k]
        loads[W] += rank_loads(layout)
        unit_comp = owner_compute_loads(layout)
        comp[W] += unit_comp
        key = tuple((s, t.spec) for (_, s), t in zip(unit.params, tensors))
        row = rows.get(key)
        if row is None:
            rows[key] = row = dict(
                st,
                unit=unit.name,
                count=0,
                seconds=0.0,
                fsdp2_padding_ratio=f2 / st["total_elements"],
                owner_moved_blocks=0,
                owner_moved_elements=0,
                ranks=W,
                _comp=np.zeros(W, dtype=np.float64),
            )
        row["count"] += 1
        row["seconds"] += dt
        row["owner_moved_blocks"] += st["owner_moved_blocks"]
        row["owner_moved_elements"] += st["owner_moved_elements"]
        row["_comp"] += unit_comp
    for row in rows.values():
        row["owner_moved_bytes_ratio"] = row["owner_moved_elements"] / (row["total_elements"] * row["count"])
        c = row.pop("_comp")  # the row's units together: their owners were balanced with all the others
        row["owner_compute_max_over_mean"] = float(c.max() / c.mean()) if c.sum() > 0 else None
    total = sums["total_elements"]
    if total == 0:
        raise ValueError(f"model {name} has no parameter elements: there is nothing to shard or plan")
    load_ratios = [float(v.max() / v.mean()) for v in loads.values() if v.sum() > 0]
    comp_ratios = [float(v.max() / v.mean()) for v in comp.values() if v.sum() > 0]
    summary = {
        "model": name,
        "world_size": world_size,
        "tp": tp,
        "ep": ep,
        "granularity": g,
        "total_elements": int(total),
        "padded_elements": int(sums["padded_elements"]),
        "padding_ratio": sums["padded_elements"] / total,
        "split_blocks": int(sums["split_blocks"]),
        "split_bytes_ratio": sums["split_elements"] / total,
        "owner_blocks": int(sums["owner_blocks"]),
        "owner_cut_blocks": int(sums["owner_cut_blocks"]),
        "owner_moved_blocks": int(sums["owner_moved_blocks"]),
        "owner_moved_bytes_ratio": sums["owner_moved_elements"] / total,
        "fsdp2_padding_ratio": sums["fsdp2_padded"] / total,
        "max_over_mean_load": max(load_ratios),
        "owner_compute_max_over_mean": max(comp_ratios) if comp_ratios else None,
        "plan_seconds": t_plan,
    }
    summary["_rows"] = list(rows.values())
    if return_layouts:
        summary["_units"] = list(zip(units, layouts))
    return summary


def run_plan(args) -> dict:
    """``plan_model`` for the CLI's parsed arguments (``--model`` or ``--module``)."""
    if args.module:
        model = _load_module(args.module)
    elif args.model:
        model = args.model
    else:
        raise ValueError(f"pass --model NAME (known models: {', '.join(model_names())}) or --module pkg.mod:factory")
    summary = plan_model(
        model,
        args.world_size,
        tp=args.tp,
        ep=args.ep,
        granularity=args.granularity,
        optimizer=args.optimizer,
        allow_split=not args.no_split,
        itemsize=args.itemsize,
        alignment=args.alignment,
    )
    summary["model"] = args.module or args.model
    return summary


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


# What each column of the table means: printed under the table and in `plan --help`.
COLUMNS = (
    ("unit", "an FSDP unit (one fully_shard call); units with the same params share a row"),
    ("x", "how many units that row stands for"),
    ("S (elems)", "elements each rank holds of the unit's flat buffer (W * S in all, padding included)"),
    ("padding", "padding elements / real elements, RaggedShard (this plan)"),
    ("fsdp2 pad", "the same for FSDP2's even Shard(0) rows under the same block constraint"),
    ("split blk", "blocks a rank boundary cuts: gathered to one owner rank, computed there, scattered back"),
    ("split bytes", "bytes of those cut blocks that travel to and from their owners each step"),
    ("split %", "split bytes / all bytes of the unit"),
    ("mat cut", "owner-computed blocks (Muon's whole matrices) a rank boundary cuts, per unit"),
    (
        "mat moved",
        "owner-computed blocks whose owner does not hold them whole (cut, or moved for balance), all x units",
    ),
    ("moved %", "elements of those not on their owner (they travel there and back each step) / all elements"),
    ("load max/mean", "real elements on the fullest rank / the mean over ranks (1.000: even)"),
    (
        "NS max/mean",
        "Newton-Schulz work (m*n*min(m,n)) of the busiest owner / the mean, the row's x units together "
        "(Muon only; - otherwise)",
    ),
    ("seconds", "planner time for those units"),
)


def columns_legend() -> str:
    width = max(len(name) for name, _ in COLUMNS)
    return "columns:\n" + "\n".join(f"  {name:<{width}}  {text}" for name, text in COLUMNS)


def print_table(summary: dict, itemsize: int, out=None) -> None:
    out = out or sys.stdout
    head = (
        f"{'unit':<14}{'x':>4}{'S (elems)':>14}{'padding':>10}{'fsdp2 pad':>11}{'split blk':>10}"
        f"{'split bytes':>13}{'split %':>9}{'mat cut':>9}{'mat moved':>11}{'moved %':>9}"
        f"{'load max/mean':>15}{'NS max/mean':>13}{'seconds':>9}"
    )
    parallel = "".join(f"  {k} {summary[k]}" for k in ("tp", "ep") if summary.get(k, 1) > 1)
    print(
        f"model {summary['model']}  world_size {summary['world_size']}{parallel}  granularity {summary['granularity']}",
        file=out,
    )
    print(head, file=out)
    for r in summary["_rows"]:
        print(
            f"{r['unit']:<14}{r['count']:>4}{r['shard_size']:>14}{_pct(r['padding_ratio']):>10}"
            f"{_pct(r['fsdp2_padding_ratio']):>11}{r['split_blocks']:>10}{r['split_elements'] * itemsize:>13}"
            f"{_pct(r['split_bytes_ratio']):>9}{r['owner_cut_blocks']:>9}{r['owner_moved_blocks']:>11}"
            f"{_pct(r['owner_moved_bytes_ratio']):>9}{_ratio(r['load_max_over_mean']):>15}"
            f"{_ratio(r['owner_compute_max_over_mean']):>13}{r['seconds']:>9.3f}",
            file=out,
        )
    s = summary
    split_bytes = round(s["split_bytes_ratio"] * s["total_elements"]) * itemsize
    print(
        f"{'all units':<14}{sum(r['count'] for r in s['_rows']):>4}{'':>14}{_pct(s['padding_ratio']):>10}"
        f"{_pct(s['fsdp2_padding_ratio']):>11}{s['split_blocks']:>10}{split_bytes:>13}"
        f"{_pct(s['split_bytes_ratio']):>9}{s['owner_cut_blocks']:>9}{s['owner_moved_blocks']:>11}"
        f"{_pct(s['owner_moved_bytes_ratio']):>9}{_ratio(s['max_over_mean_load']):>15}"
        f"{_ratio(s['owner_compute_max_over_mean']):>13}{s['plan_seconds']:>9.3f}",
        file=out,
    )
    print(f"overhead (padding + split bytes): {_pct(s['padding_ratio'] + s['split_bytes_ratio'])}", file=out)
    if s["owner_blocks"]:
        print(
            f"owner-computed blocks: {s['owner_blocks']}, {s['owner_cut_blocks']} cut by a rank boundary, "
            f"{s['owner_moved_blocks']} computed on a rank that does not hold them whole "
            f"({_pct(s['owner_moved_bytes_ratio'])} of the bytes travel to their owners and back each step)",
            file=out,
        )
    print(columns_legend(), file=out)


def cmd_plan(args) -> int:
    from ragged_optim.cli import UsageError  # (cli imports this module lazily)

    if args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {args.world_size}")
    if args.granularity < 1:
        raise UsageError(f"--granularity must be >= 1, got {args.granularity}")
    if args.itemsize < 1:  # (here: the planner's own message would name the first tensor, not the flag)
        raise UsageError(f"--itemsize must be >= 1 (bytes per element), got {args.itemsize}")
    try:
        summary = run_plan(args)
    except ImportError as e:
        raise UsageError(f"--module {args.module}: cannot import it ({e})") from e
    except (ValueError, AttributeError) as e:
        raise UsageError(str(e)) from e
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if not k.startswith("_")}))
    else:
        print_table(summary, args.itemsize)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="plan the RaggedShard layout of a model and report padding, split blocks and balance",
        description=__doc__,
        epilog=columns_legend(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # One source of the model: --module silently won over --model before.
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help=f"catalog model: {', '.join(_model_names_for_help())}")
    source.add_argument("--module", help="pkg.mod:factory building an nn.Module (called on the meta device)")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks W")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size: units at TP-local shapes over W / tp ranks")
    p.add_argument(
        "--ep", type=int, default=1, help="expert parallel size: expert stacks E / ep per rank, over W / ep ranks"
    )
    p.add_argument("--granularity", type=int, default=1, help="G: rows for matrices, elements for 1-D tensors")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="block specs as that optimizer needs")
    p.add_argument("--no-split", action="store_true", help="never split a block: pad instead")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--itemsize", type=int, default=4, help="bytes per element (default 4)")
    p.add_argument("--alignment", type=int, default=16, help="collective alignment in bytes (default 16)")
    p.set_defaults(func=cmd_plan)
    return p
