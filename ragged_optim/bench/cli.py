"""`ragged-optim bench NAME [--world-size W] [--steps N] [--seeds N] [--families F,..] [--json] [--out FILE]`.

NAME is one of the benchmark modules present under ``ragged_optim.bench`` or ``all``. ``--json`` prints exactly
one JSON object on stdout (the benchmark's dict; for ``all``, ``{name: dict}``); without it a readable table.
``--out``: for one benchmark, a file to write the JSON to; for ``all``, a folder (default ``benchmarks/results``)
that receives ``latest.json`` and ``latest.md``, both with the machine under ``machine``: CPU model, its flags that
decide kernel speed (avx2, avx512_bf16, amx_*), ATen's CPU level, Muon's ``ns_matmul="auto"`` choice for bf16,
threads, torch version, date.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import time

from ragged_optim.cli import UsageError, module_doc

#: Every benchmark the CLI knows of, in the order ``bench all`` runs them; a module that is not there yet is
#: listed as unavailable.
BENCHMARKS = ("fsdp", "memory", "muon", "shampoo", "soap", "adamw8bit", "comm", "hsdp", "tp", "peers")
DEFAULT_OUT_DIR = os.path.join("benchmarks", "results")


def _module_name(name: str) -> str:
    return f"{__package__}.{name}"


def available() -> list[str]:
    """The benchmark modules present (found without importing them)."""
    out = []
    for name in BENCHMARKS:
        try:
            if importlib.util.find_spec(_module_name(name)) is not None:
                out.append(name)
        except (ImportError, ValueError):
            continue
    return out


def run_benchmark(
    name: str, world_size: int | None = None, steps: int | None = None, *, lenient: bool = False, **kw
) -> dict:
    """Import ``ragged_optim.bench.<name>`` and call its ``run``; None arguments keep the module's defaults.
    ``seeds``/``families`` that the benchmark does not take raise a ValueError, or are dropped when ``lenient``
    (``bench all``)."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose one of {list(BENCHMARKS)}")
    try:
        module = importlib.import_module(_module_name(name))
    except ModuleNotFoundError as e:
        if e.name == _module_name(name):
            raise ValueError(f"benchmark {name!r} is not available here; available: {available()}") from None
        raise
    accepted = inspect.signature(module.run).parameters
    if kw.get("device", "cpu") != "cpu" and "device" not in accepted:
        raise UsageError(f"benchmark {name!r} runs on CPU only (--device is for: memory, fsdp, peers)")
    for option, users in (("seeds", "adamw8bit, comm, peers"), ("families", "peers")):
        if kw.get(option) is not None and option not in accepted:
            if lenient:
                kw.pop(option)
                continue
            raise UsageError(f"benchmark {name!r} takes no --{option} (it is for: {users})")
    kw = {k: v for k, v in kw.items() if v is not None}
    if world_size is not None:
        kw["world_size"] = world_size
    if steps is not None:
        kw["steps"] = steps
    return module.run(**kw)


def _out_problem(out: str, *, folder: bool) -> str | None:
    """What is wrong with ``--out`` (checked before a run that can take many minutes, so an unusable path does
    not raise after it and lose the ``--json`` results): None when it can be written."""
    if folder:
        if os.path.exists(out) and not os.path.isdir(out):
            return f"--out {out!r}: bench all writes a folder (latest.json, latest.md), and this is a file"
        target = out if os.path.isdir(out) else os.path.dirname(os.path.abspath(out))
    else:
        if os.path.isdir(out):
            example = os.path.join(out, "x.json")
            return f"--out {out!r} is a folder; pass a file for one benchmark's JSON (e.g. {example!r})"
        target = os.path.dirname(os.path.abspath(out))
    try:  # a file made and removed there: os.access says yes to root anywhere, /proc included
        os.makedirs(target, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as e:
        return f"--out {out!r}: cannot write in {target!r} ({e.strerror or e})"
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")


def _rows_table(name: str, result: dict) -> str | None:
    """The benchmark's own Markdown table of its rows, if it has one and the result holds them."""
    if "families" not in result:  # (checked first: a benchmark that failed to import has only "error")
        return None
    render = getattr(importlib.import_module(_module_name(name)), "markdown_table", None)
    return None if render is None else render(result)


def cmd_bench(args: argparse.Namespace) -> int:
    from ragged_optim.bench.common import format_table, machine_info, markdown_report

    for option, value in (("--world-size", args.world_size), ("--steps", args.steps), ("--seeds", args.seeds)):
        if value is not None and value < 1:
            raise UsageError(f"{option} must be >= 1, got {value} (omit it for the benchmark's default)")
    if args.families is not None:
        from ragged_optim.bench.peers import FAMILIES

        families = [f.strip() for f in args.families.split(",") if f.strip()]
        unknown = [f for f in families if f not in FAMILIES]
        if not families or unknown:
            raise UsageError(f"--families takes a comma-separated list of {list(FAMILIES)}, got {args.families!r}")
    if args.out is not None:
        if problem := _out_problem(args.out, folder=args.name == "all"):
            raise UsageError(problem)
    if args.device != "cpu" and args.device.startswith("cuda") and not _cuda_available():
        raise UsageError(f"--device {args.device}: no CUDA device here (torch.cuda.is_available() is False)")
    names = available() if args.name == "all" else [args.name]
    if args.name != "all" and args.name not in available():
        print(f"benchmark {args.name!r} is not available here; available: {', '.join(available())}", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    failed = False
    # Anything a benchmark (or a forked rank) prints goes to stderr, so that stdout holds only the result.
    with contextlib.redirect_stdout(sys.stderr):
        for name in names:
            t0 = time.perf_counter()
            try:
                extra = {"device": args.device} if args.device != "cpu" else {}
                if args.seeds is not None:
                    extra["seeds"] = args.seeds
                if args.families is not None:
                    extra["families"] = [f.strip() for f in args.families.split(",") if f.strip()]
                results[name] = run_benchmark(name, args.world_size, args.steps, lenient=args.name == "all", **extra)
            except Exception as e:
                if args.name != "all" or isinstance(e, UsageError):
                    raise
                failed = True
                results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            print(f"[bench] {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    payload = results if args.name == "all" else results[args.name]
    if args.name == "all":
        machine = machine_info()
        payload = {"machine": machine, **results}  # what the figures were measured on, recorded with them
        out_dir = args.out or DEFAULT_OUT_DIR
        _write_json(os.path.join(out_dir, "latest.json"), payload)
        with open(os.path.join(out_dir, "latest.md"), "w") as f:
            tables = {name: t for name, res in results.items() if (t := _rows_table(name, res))}
            f.write(markdown_report(results, machine, tables) + "\n")
        print(f"[bench] wrote {out_dir}/latest.json and latest.md", file=sys.stderr)
    elif args.out:
        _write_json(args.out, payload)
    if args.json:
        print(json.dumps(payload, default=str))
    else:
        for name, res in results.items():
            rows_table = _rows_table(name, res)
            keys = {k: v for k, v in res.items() if not (rows_table and k == "families")}
            print(format_table(keys, title=f"bench {name}"))
            print()
            if rows_table:  # a benchmark with rows (peers): them as a table, not one line of nested dicts
                print(rows_table)
                print()
    return 1 if failed else 0


#: How long each benchmark takes at its defaults, as measured on this project's 2 shared CPU cores (times move with
#: the load: read them as the order of magnitude). Where none was recorded, the text says so.
TYPICAL_TIME = {
    "fsdp": "about 2 min (4 ranks, docs/benchmarks.md)",
    "memory": "several minutes for its three configurations (4 ranks, a 54M-param GPT; the Muon configuration alone "
    "ran with a 2600 s timeout); not timed end to end",
    "muon": "about 45 s (4 ranks, docs/benchmarks.md)",
    "shampoo": "17 s (4 ranks; 2026-12-02, load average 5-7 from other jobs)",
    "soap": "17 s (4 ranks; 2026-12-02, load average 6-8 from other jobs)",
    "adamw8bit": "not recorded (3 seeds x 100 steps of the tiny GPT, torchao's side on FSDP2 as well)",
    "comm": "not recorded (3 configurations x 3 seeds of the small GPT on 4 ranks)",
    "tp": "67 s for the training part (4 ranks as a 2 x 2 mesh, 6 steps of each side; 2026-12-02, load average 13-14 "
    "from other jobs), then 134 s for the Muon part (2 x 44 bench20m matrices, 2 timed steps; load average 24)",
    "hsdp": "67 s (4 ranks, 2 x 6 steps of the small GPT; 2026-12-02, load average 8-10 from other jobs)",
    "peers": "about 15 min per family alone on the machine (muon: 803-916 s, docs/benchmarks.md), over an hour for "
    "all four families (3 seeds x 300 steps each; one process)",
}


def _description(name: str) -> str:
    """``bench NAME --help``: the benchmark module's own docstring (read from its source, without importing it:
    the benchmarks import torch), its typical time, where its JSON keys are documented."""
    try:
        doc = module_doc(_module_name(name))
    except ModuleNotFoundError:
        doc = f"`bench {name}`: not available here."
    return (
        f"{doc}\n\nTypical time: {TYPICAL_TIME.get(name, 'not recorded')}.\n"
        f'Every key of its JSON (--json): docs/benchmarks.md, "JSON keys of each benchmark", `bench {name}`.'
    )


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--world-size", type=int, default=None, help="number of gloo ranks (default: the benchmark's: 4; adamw8bit 3)"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: the benchmark's)")
    p.add_argument(
        "--seeds", type=int, default=None, help="number of seeds, 0 .. N-1 (adamw8bit, comm, peers; default theirs)"
    )
    p.add_argument("--families", default=None, help="peers only: comma-separated muon,adamw8bit,shampoo,soap")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks (default); cuda: NCCL ranks, one GPU each (memory, fsdp), or one GPU (peers)",
    )
    p.add_argument("--out", default=None, help="JSON file (one benchmark) or folder (all; default benchmarks/results)")
    p.set_defaults(func=cmd_bench)


def add_parser(subparsers) -> argparse.ArgumentParser:
    have = available()
    missing = [n for n in BENCHMARKS if n not in have]
    listing = f"available: {', '.join(have) or 'none'}" + (f"; unavailable: {', '.join(missing)}" if missing else "")
    p = subparsers.add_parser(
        "bench",
        help="benchmarks against the peer (torch FSDP2, torch.optim.Muon, ...) in the same run",
        description=f"{__doc__}\nBenchmarks {listing}. `bench NAME --help`: what NAME measures, its typical time "
        "and where its keys are documented.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = p.add_subparsers(dest="name", required=True, metavar="NAME", help=f"{listing}; or 'all'")
    for name in (*BENCHMARKS, "all"):
        if name == "all":
            description = (
                f"{__doc__}\nRuns every available benchmark in turn ({', '.join(have) or 'none'}). Typical time: the "
                "sum of theirs, well over an hour with peers."
            )
            summary = "every available benchmark, in turn; writes benchmarks/results/latest.{json,md}"
        else:
            description = _description(name)
            summary = _constant(name, "DESCRIPTION") or _first_line(description)
        sp = names.add_parser(
            name, help=summary, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        _add_options(sp)
    return p


def _first_line(doc: str) -> str:
    """A benchmark's one-line summary: its docstring's first sentence, without the leading `bench NAME`: label."""
    line = doc.split("\n\n", 1)[0].replace("\n", " ")
    return line.split(": ", 1)[1] if line.startswith("`bench ") and ": " in line else line


def _constant(name: str, attr: str) -> str | None:
    """A string constant ``attr`` of benchmark ``name`` (its one-line ``DESCRIPTION``), read from the source
    without importing the module; None if it has none."""
    import ast

    spec = importlib.util.find_spec(_module_name(name))
    if spec is None or not spec.origin:
        return None
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == attr for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    return None
