"""How far each 8-bit AdamW's update is from fp32 AdamW's on the same gradients: a low-noise figure where the final
validation loss of a few seeds cannot rank 8-bit optimizers (`bench peers`: the seeds' spread is larger than the
gaps between them).

fp32 ``torch.optim.AdamW`` trains the ``small`` GPT with `bench peers`' hyperparameters, batches and lr schedule.
Every step, each 8-bit optimizer (ro.AdamW8bit, bitsandbytes' and torchao's AdamW8bit when installed) gets the
same gradients and starts from the same params as the reference, keeping only its own (quantized) moments from
step to step; so the difference of its update from the reference's is what its state quantization does, not where
an earlier difference led. Figure: ``||du - du_ref|| / ||du_ref||`` over the params with 8-bit state (>= 4096
elements, every optimizer's threshold), per step; its mean, its mean over the last 50 steps, and its max.

    python benchmarks/adamw8bit_fidelity.py [--steps 300] [--seeds 0 1 2]

Prints one JSON line per seed; a peer that is not installed is a row with its reason. About 1 s a step here.
"""

from __future__ import annotations

import argparse
import json

import torch

from ragged_optim.bench import peers
from ragged_optim.data import load_corpus
from ragged_optim.models import build_model

ROWS = ("ro.AdamW8bit", "bitsandbytes AdamW8bit", "torchao AdamW8bit")
MIN_8BIT = 4096


def run_seed(seed: int, steps: int, corpus) -> dict:
    ref = build_model(peers.PRESET, seed=seed)
    ref_opt = peers._make("torch.optim.AdamW (fp32)", ref)
    params = list(ref.parameters())
    big = [i for i, p in enumerate(params) if p.numel() >= MIN_8BIT]
    sides, out = {}, {"seed": seed, "steps": steps}
    for row in ROWS:
        holder = torch.nn.Module()  # the peers' factory takes a module: one holding copies of the params
        copies = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for p in params])
        holder.params = copies
        try:
            sides[row] = (list(copies), peers._make(row, holder))
        except Exception as e:  # noqa: BLE001 (a missing peer: a row with its reason)
            out[row] = {"status": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    errs: dict[str, list[float]] = {row: [] for row in sides}
    for s in range(steps):
        mult = peers.lr_multiplier(s, steps)
        for opt in [ref_opt] + [opt for _, opt in sides.values()]:
            peers._set_lr(opt, [peers.ADAM_LR] * len(opt.param_groups), mult)  # (torchao's lr is a tensor)
        x, y = peers._batch("train", s, ref.config.seq_len, corpus, "cpu", seed=seed)
        ref(x, y).backward()
        before = [p.detach().clone() for p in params]
        for copies, _ in sides.values():
            for q, p, b in zip(copies, params, before):
                q.data.copy_(b)
                q.grad = p.grad.clone()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        du_ref = torch.cat([(params[i].detach() - before[i]).flatten() for i in big])
        for row, (copies, opt) in list(sides.items()):
            try:
                opt.step()
            except Exception as e:  # noqa: BLE001 (a peer failing mid-run: keep its reason, go on)
                out[row] = {"status": f"{type(e).__name__} at step {s}: {str(e).splitlines()[0] if str(e) else ''}"}
                del sides[row], errs[row]
                continue
            du = torch.cat([(copies[i].detach() - before[i]).flatten() for i in big])
            errs[row].append(((du - du_ref).norm() / du_ref.norm()).item())
    for row, e in errs.items():
        tail = e[-50:]
        out[row] = {
            "status": "ok",
            "update_rel_err_mean": sum(e) / len(e),
            "update_rel_err_last50_mean": sum(tail) / len(tail),
            "update_rel_err_max": max(e),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = ap.parse_args()
    torch.set_num_threads(1)
    corpus = load_corpus()
    for seed in args.seeds:
        print(json.dumps(run_seed(seed, args.steps, corpus)), flush=True)


if __name__ == "__main__":
    main()
