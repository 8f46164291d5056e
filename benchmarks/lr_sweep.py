"""A learning-rate sweep of `ragged-optim train` per optimizer (issue 35, item 2): each (optimizer, lr, seed) is one
run of the train job at its default preset, and the final validation loss is what is compared.

    .venv/bin/python benchmarks/lr_sweep.py --out benchmarks/results/lr_sweep_200steps.json

With --out naming an existing results file, its runs are kept and only the missing (optimizer, lr, seed) runs are
made; each run records the commit it ran at and the 1-minute load average when it started (times on a loaded
machine are longer; the losses do not depend on the load). About 60 to 120 s per 200-step run at 2 ranks on a
2-core machine. Prints one JSON object: the runs and, per optimizer, the lr with the lowest mean validation loss
over the seeds (the train job's default lrs are these: tests/train/test_lr_defaults.py). The README's optimizer table:

    .venv/bin/python benchmarks/lr_sweep.py --table benchmarks/results/lr_sweep_200steps.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# Each grid has the best mean lr inside it, not at an edge (checked by tests/train/test_lr_defaults.py).
LRS = {
    "adamw": [1e-4, 3e-4, 1e-3, 4e-3, 1e-2, 3e-2],
    "adamw8bit": [3e-4, 1e-3, 3e-3, 1e-2],
    "muon": [1e-2, 2e-2, 5e-2, 1e-1],
    "shampoo": [1e-3, 3e-3, 1e-2, 3e-2],
    "soap": [3e-3, 1e-2, 3e-2, 1e-1],
}


def _commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return rev.stdout.strip() or "unknown"


def run_one(optimizer: str, lr: float, seed: int, steps: int, world_size: int) -> dict:
    out = tempfile.mkdtemp(prefix=f"sweep_{optimizer}_{lr}_")
    cmd = [os.path.join(os.path.dirname(sys.executable), "ragged-optim"), "train", "--optimizer", optimizer,
           "--lr", str(lr), "--seed", str(seed), "--steps", str(steps), "--world-size", str(world_size),
           "--out", out, "--no-progress"]  # fmt: skip
    load = round(os.getloadavg()[0], 2)
    start = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    seconds = round(time.time() - start, 1)
    return {"optimizer": optimizer, "lr": lr, "seed": seed, "steps": steps, "val_loss": summary["val_loss"],
            "final_train_loss_avg10": summary["final_train_loss_avg10"], "seconds": seconds,
            "load_avg_1m_at_start": load, "commit": _commit()}  # fmt: skip


def summarize(runs: list[dict]) -> dict:
    """Per optimizer: mean and range of the validation loss over the seeds at each lr, and the best mean's lr."""
    best = {}
    for opt in sorted({r["optimizer"] for r in runs}):
        by_lr = {}
        for lr in sorted({r["lr"] for r in runs if r["optimizer"] == opt}):
            losses = [r["val_loss"] for r in runs if r["optimizer"] == opt and r["lr"] == lr]
            by_lr[lr] = {"mean": statistics.mean(losses), "min": min(losses), "max": max(losses), "n": len(losses)}
        lr = min(by_lr, key=lambda k: by_lr[k]["mean"])
        best[opt] = {"lr": lr, "mean_val_loss": by_lr[lr]["mean"], "by_lr": {str(k): v for k, v in by_lr.items()}}
    return best


def _lr(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def markdown_table(result: dict) -> str:
    """The README's optimizer table: per optimizer its best lr (the train job's default), the validation loss
    there (mean over the seeds, and their range), its ratio to AdamW's at AdamW's best lr, whether every seed of
    it is below every seed of AdamW's (the seed spread), and the mean at every lr tried; best first."""
    best = result["best"]
    base = best["adamw"]["by_lr"][str(best["adamw"]["lr"])]
    head = (
        f"| optimizer | default lr (best of the sweep) | val loss, mean of {len(result['seeds'])} seeds [range] "
        "| vs AdamW | below AdamW beyond the seed spread | mean val loss at each lr tried |"
    )
    lines = [head, "|---|---|---|---|---|---|"]
    for opt in sorted(best, key=lambda o: best[o]["mean_val_loss"]):
        at = best[opt]["by_lr"][str(best[opt]["lr"])]
        beyond = "-" if opt == "adamw" else ("yes" if at["max"] < base["min"] else "no")
        tried = ", ".join(
            (
                f"**{_lr(float(k))}: {v['mean']:.3f}**"
                if float(k) == best[opt]["lr"]
                else f"{_lr(float(k))}: {v['mean']:.3f}"
            )
            for k, v in best[opt]["by_lr"].items()
        )
        lines.append(
            f"| {opt} | {_lr(best[opt]['lr'])} | {at['mean']:.3f} [{at['min']:.3f}, {at['max']:.3f}] "
            f"| {at['mean'] / base['mean']:.3f}x | {beyond} | {tried} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--optimizers", default=",".join(LRS))
    p.add_argument("--out", default=None, help="results file; its runs are kept and only missing ones are made")
    p.add_argument("--table", metavar="FILE", help="print the README's markdown table of a results file and exit")
    args = p.parse_args()
    if args.table:
        with open(args.table) as f:
            print(markdown_table(json.load(f)))
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    runs, header = [], {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        if (old["steps"], old["world_size"]) != (args.steps, args.world_size):
            sys.exit(f"{args.out} holds runs at steps {old['steps']}, world size {old['world_size']}: another --out")
        runs, header = old["runs"], {k: old[k] for k in ("provenance",) if k in old}
    have = {(r["optimizer"], r["lr"], r["seed"]) for r in runs}
    for opt in args.optimizers.split(","):
        for lr in LRS[opt]:
            for seed in seeds:
                if (opt, lr, seed) in have:
                    continue
                runs.append(run_one(opt, lr, seed, args.steps, args.world_size))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
                if args.out:  # after every run: an interrupted sweep keeps what it measured
                    _write(args.out, header, args.steps, args.world_size, runs)
    result = _result(header, args.steps, args.world_size, runs)
    if args.out:
        _write(args.out, header, args.steps, args.world_size, runs)
    print(json.dumps(result, indent=1))


def _result(header: dict, steps: int, world_size: int, runs: list[dict]) -> dict:
    seeds = sorted({r["seed"] for r in runs})
    return {**header, "steps": steps, "world_size": world_size, "seeds": seeds, "runs": runs, "best": summarize(runs)}


def _write(path: str, header: dict, steps: int, world_size: int, runs: list[dict]) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(_result(header, steps, world_size, runs), indent=1) + "\n")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
