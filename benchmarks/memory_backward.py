"""Where in a training step each side's memory peaks, and what is live then: ours (ragged_optim.fully_shard) against
torch FSDP2 on the `bench memory` GPT, counted exactly (ragged_optim.alloc_counter) with the profiler for the sites.

Step 2 is cut into intervals at the moments the gradient of each block's output is ready (the block's backward
starts then), plus the forward and the optimizer step; each interval reports the exact peak above the bytes
allocated before the model was built, the bytes allocated when it ends, and the top sites live at its peak and at
its end (``held:`` marks allocations made before step 2: shards, optimizer state). Rank 0's figures.

    .venv/bin/python benchmarks/memory_backward.py [--preset bench20m] [--world-size 4] [--kind adamw] [--stacks]

``--stacks`` records Python stacks, so that sites name the runtime's lines (several times slower). Prints one JSON
object: {side: [{"interval", "peak_bytes", "end_bytes", "sites", "end_sites"}, ...]}.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch
import torch.distributed as dist

from ragged_optim import alloc_counter
from ragged_optim.bench.memory import _build
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.data import get_batch
from ragged_optim.memory import settle, sites_at_peak
from ragged_optim.models import get_config


def _side(cfg, kind, side, batches, stacks, top):
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    settle()
    before = alloc_counter.stats()
    marks = []  # (interval name, (peak, peak_seq, phase) of the interval that ends here, counter stats now)

    def mark(name):
        marks.append((name, alloc_counter.reset_peak(), alloc_counter.stats()))

    alloc_counter.start_recording()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=stacks) as prof:
            model, opts = _build(cfg, kind, side, "cpu")
            for step, (x, y) in enumerate(batches):
                hooks = []
                if step == 1:
                    settle()
                    start_seq = alloc_counter.stats().seq
                    mark("before step 2")
                    n = len(model.layers)
                    for i, block in enumerate(model.layers):
                        # the grad of layers.i's output is ready: the backward of what follows it has run
                        ended = f"backward of layers.{i + 1}" if i + 1 < n else "backward of the head (root unit)"

                        def on_output(module, args, out, ended=ended):
                            if out.requires_grad:
                                out.register_hook(lambda g: mark(ended))

                        hooks.append(block.register_forward_hook(on_output))
                loss = model(x, y)
                if step == 1:
                    mark("forward")
                loss.backward()
                del loss
                if step == 1:
                    mark("backward of layers.0 and the embeddings, to the end of backward")
                for opt in opts:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if step == 1:
                    mark("optimizer step and zero_grad")
                for h in hooks:
                    h.remove()
    finally:
        alloc_counter.stop_recording()
    out = []
    for name, (peak, peak_seq, _), now in marks[1:]:
        at_peak, at_end = (
            sites_at_peak(prof, seq, top=top, base_seq=before.seq, held_seq=start_seq) for seq in (peak_seq, now.seq)
        )
        out.append(
            {
                "interval": name,
                "peak_bytes": peak - before.current,
                "end_bytes": now.current - before.current,
                "sites": at_peak,
                "end_sites": at_end,
            }
        )
    del model, opts, prof
    gc.collect()
    return out


def _rank(rank, world_size, preset, kind, stacks, top):
    cfg = get_config(preset, seq_len=32)
    batches = [get_batch("train", world_size, cfg.seq_len, s, rank, world_size) for s in range(2)]
    res = {}
    for side in ("ours", "fsdp2"):
        dist.barrier()
        res[side] = _side(cfg, kind, side, batches, stacks, top)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench20m")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--kind", default="adamw", choices=("adamw", "muon"))
    p.add_argument("--stacks", action="store_true")
    p.add_argument("--top", type=int, default=6)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    alloc_counter.install()  # built here once; the forked ranks inherit it
    res = run_on_ranks(_rank, a.world_size, a.preset, a.kind, a.stacks, a.top, timeout_s=1800)[0]
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
