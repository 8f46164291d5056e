"""A learning-rate sweep of `ragged-optim train` per optimizer (issue 35, item 2): each (optimizer, lr, seed) is one
run of the train job at its default preset, and the final validation loss is what is compared.

    .venv/bin/python benchmarks/lr_sweep.py --steps 200 --world-size 2 --seeds 0 --out benchmarks/results/lr_sweep.json

About 85 s per 200-step run at 2 ranks on this 2-core machine (idle). Prints one JSON object: the runs and, per
optimizer, the lr with the lowest mean validation loss over the seeds.
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

LRS = {
    "adamw": [1e-3, 4e-3, 1e-2, 3e-2],
    "soap": [3e-3, 1e-2, 3e-2, 1e-1],
    "shampoo": [1e-3, 3e-3, 1e-2, 3e-2],
}


def run_one(optimizer: str, lr: float, seed: int, steps: int, world_size: int) -> dict:
    out = tempfile.mkdtemp(prefix=f"sweep_{optimizer}_{lr}_")
    cmd = [os.path.join(os.path.dirname(sys.executable), "ragged-optim"), "train", "--optimizer", optimizer,
           "--lr", str(lr), "--seed", str(seed), "--steps", str(steps), "--world-size", str(world_size),
           "--out", out, "--no-progress"]  # fmt: skip
    start = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    seconds = round(time.time() - start, 1)
    return {"optimizer": optimizer, "lr": lr, "seed": seed, "steps": steps, "val_loss": summary["val_loss"],
            "final_train_loss_avg10": summary["final_train_loss_avg10"], "seconds": seconds}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--optimizers", default=",".join(LRS))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    for opt in args.optimizers.split(","):
        for lr in LRS[opt]:
            for seed in seeds:
                runs.append(run_one(opt, lr, seed, args.steps, args.world_size))
                print(json.dumps(runs[-1]), file=sys.stderr)
    best = {}
    for opt in args.optimizers.split(","):
        means = {lr: statistics.mean(r["val_loss"] for r in runs if r["optimizer"] == opt and r["lr"] == lr)
                 for lr in LRS[opt]}  # fmt: skip
        lr = min(means, key=means.get)
        best[opt] = {"lr": lr, "mean_val_loss": means[lr], "by_lr": means}
    result = {"steps": args.steps, "world_size": args.world_size, "seeds": seeds, "runs": runs, "best": best}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
