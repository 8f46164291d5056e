"""`bench peers` one seed per process, then merged: the same keys as one process that trained every seed.

The default 3 seeds x 300 steps of a slow family (Muon with torch's bf16 Newton-Schulz on a CPU without a bf16
GEMM, ~1.5 h of one core) fit in a session only when the seeds run side by side. Each process trains one seed
exactly as ``peers.run`` does (same init, batches, rotated order, only ``opt.step()`` timed, one thread) and
writes every row's per-step times and final loss; ``--merge`` feeds those to ``peers.summarize``, so the step-time
medians are over all steps of all seeds, as in one process.

    python benchmarks/peers_by_seed.py --seed S --families muon [--steps 300] --out seedS.json
    python benchmarks/peers_by_seed.py --merge seed0.json seed1.json seed2.json

The merge prints the result as one JSON line, then the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ragged_optim.bench import peers


def train(seed: int, families: list[str], steps: int, device: str) -> dict:
    from ragged_optim.data import load_corpus

    try:
        _, rows = peers.rows_of(families)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    runs = peers._train_seed(rows, seed, steps, load_corpus(), device)
    return {"seed": seed, "families": families, "steps": steps, "device": device,
            "seconds": time.perf_counter() - t0, "rows": runs}  # fmt: skip


def merge(paths: list[str]) -> dict:
    parts = [json.load(open(p)) for p in paths]
    first = parts[0]
    for p, part in zip(paths, parts):
        if (part["families"], part["steps"], part["device"]) != (first["families"], first["steps"], first["device"]):
            raise SystemExit(f"{p} ran other families, steps or device than {paths[0]}: cannot merge them")
    seeds = [part["seed"] for part in parts]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"the same seed twice among {paths}")
    per_seed = {part["seed"]: part["rows"] for part in parts}
    return peers.summarize(per_seed, first["families"], first["steps"], first["device"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int)
    ap.add_argument("--families", default="muon", help="comma-separated: muon,adamw8bit,shampoo,soap")
    ap.add_argument("--steps", type=int, default=peers.DEFAULT_STEPS)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", help="where the seed's JSON goes")
    ap.add_argument("--merge", nargs="+", metavar="SEED_JSON", help="merge these seeds' files and print the result")
    args = ap.parse_args(argv)
    if args.merge:
        result = merge(args.merge)
        print(json.dumps(result))
        print(peers.markdown_table(result))
        return 0
    if args.seed is None or not args.out:
        ap.error("give --seed and --out to train one seed, or --merge FILES")
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    part = train(args.seed, families, args.steps, args.device)
    with open(args.out, "w") as f:
        json.dump(part, f)
    print(f"[peers_by_seed] seed {args.seed}: {part['seconds']:.0f} s -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
