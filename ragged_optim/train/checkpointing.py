"""Training checkpoints: model and optimizer state, step, loss history and per-rank RNG state."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ragged_optim.checkpoint import _barrier, _broadcast_obj, load_checkpoint, save_checkpoint

_CKPT_RE = re.compile(r"^step_(\d{8})$")


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """The newest complete checkpoint folder (``step_NNNNNNNN`` with a ``meta.json``), or None."""
    if not os.path.isdir(ckpt_dir):
        return None
    steps = sorted(
        int(m.group(1))
        for m in map(_CKPT_RE.match, os.listdir(ckpt_dir))
        if m and os.path.isfile(os.path.join(ckpt_dir, m.group(0), "meta.json"))
    )
    return os.path.join(ckpt_dir, f"step_{steps[-1]:08d}") if steps else None


class Checkpointer:
    """Model + optimizer via torch.distributed.checkpoint (``ragged_optim.save_checkpoint`` for our sharding, which
    reshards to any world size; torch's ``get_state_dict`` for FSDP2), plus step, loss history and RNG state.

    A checkpoint is written into ``.tmp-step_N-<id>`` and renamed to ``step_N`` once every rank has finished, with
    ``meta.json`` written last: a folder named ``step_N`` holding ``meta.json`` is complete.
    """

    def __init__(self, ckpt_dir: str, kind: str, rank: int, world_size: int, keep: int = 2) -> None:
        self.dir = ckpt_dir
        self.kind = kind
        self.rank = rank
        self.world_size = world_size
        self.keep = keep

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer, meta: dict) -> str:
        import torch.distributed.checkpoint as dcp

        final = os.path.join(self.dir, f"step_{step:08d}")
        # a folder of this save's own (rank 0 names it): two runs sharing --checkpoint-dir each write their own
        # (a shared .tmp-step_N would let each run's rank 0 delete the other's)
        tmp = None
        if self.rank == 0:
            os.makedirs(self.dir, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".tmp-step_{step:08d}-", dir=self.dir)
        tmp = _broadcast_obj(tmp)
        if self.kind == "ours":
            save_checkpoint(os.path.join(tmp, "state"), model, [opt])
        else:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, os.path.join(tmp, f"rng_rank{self.rank}.pt"))
        _barrier()
        if self.rank == 0:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump({**meta, "step": step, "world_size": self.world_size}, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        done = sorted(d for d in os.listdir(self.dir) if _CKPT_RE.match(d))
        for d in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(os.path.join(self.dir, d), ignore_errors=True)

    def load(self, path: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        import torch.distributed.checkpoint as dcp

        if self.kind == "ours":
            load_checkpoint(os.path.join(path, "state"), model, [opt])
        else:
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        rng_path = os.path.join(path, f"rng_rank{self.rank}.pt")
        if meta.get("world_size") == self.world_size and os.path.isfile(rng_path):
            rng = torch.load(rng_path, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return meta
