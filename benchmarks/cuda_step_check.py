"""A training step on CUDA at world size 1 (NCCL): no host sync after warm-up, and the same result as one process.

For each optimizer (ro.Muon, ro.AdamW8bit, ro.Shampoo, ro.SOAP, and torch.optim.AdamW on our sharded params), a
`small` GPT from `ragged_optim.models` is sharded with `ro.fully_shard` (bf16 params, fp32 reduce: the copy-in,
all-gather and reduce streams all run), trained two warm-up steps, then:

- one step (forward, backward, `opt.step()`) under `torch.cuda.set_sync_debug_mode("error")` with the non-finite
  check off: any device-to-host sync raises;
- one step under `set_sync_debug_mode("warn")` with the check on: exactly one sync (the non-finite flag) is
  expected, counted from the warnings.

For our optimizers the same sync-free step once more after ro.save_checkpoint / ro.load_checkpoint into a fresh
model and optimizer, with the step counters checked to be on the CPU (`<name>_resumed`).

Then AdamW: our sharded run against the same model trained in one process without any sharding, 4 steps, the
largest parameter difference relative to the largest parameter change (the streams must not change a value).

Prints one JSON line; exit 0 only if every check passes. Run by benchmarks/gpu_check.sh; needs one CUDA GPU.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import ragged_optim as ro
from ragged_optim.data import get_batch
from ragged_optim.models import build_model, get_config
from ragged_optim.optim.nonfinite import set_nonfinite_policy
from ragged_optim.train import shard_model

OPTIMIZERS = {
    "muon": lambda m: ro.Muon(ro.muon_param_groups(m)),
    "adamw8bit": lambda m: ro.AdamW8bit(m.parameters()),
    "shampoo": lambda m: ro.Shampoo(m.parameters(), precondition_frequency=8, start_preconditioning_step=8),
    "soap": lambda m: ro.SOAP(m.parameters(), precondition_frequency=8),
    "torch_adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
}


def _batches(cfg, n, device):
    return [tuple(t.to(device) for t in get_batch("train", 8, cfg.seq_len, s, 0, 1)) for s in range(n)]


def _step(model, opt, x, y):
    model(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync_free_step(model, opt, batch) -> dict:
    """One step under set_sync_debug_mode("error"): ``{"sync_free_step": bool}`` (and the error)."""
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        _step(model, opt, *batch)
        return {"sync_free_step": True}
    except RuntimeError as e:
        return {"sync_free_step": False, "error": str(e).splitlines()[0][:300]}
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _sync_check(name, cfg, device) -> dict:
    model = build_model(cfg, seed=0, device=device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_model(model, "ours", mp_policy=mp)
    opt = OPTIMIZERS[name](model)
    batches = _batches(cfg, 4, device)
    for b in batches[:2]:
        _step(model, opt, *b)
    ours = type(opt).__module__.startswith("ragged_optim")  # ours have the non-finite check
    if ours:
        set_nonfinite_policy(opt, "off")
    out = _sync_free_step(model, opt, batches[2])
    if ours:
        set_nonfinite_policy(opt, "skip")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _step(model, opt, *batches[3])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out["syncs_with_nonfinite_check"] = sum("synchroniz" in str(w.message) for w in caught)
    out["ok"] = out["sync_free_step"] and out.get("syncs_with_nonfinite_check", 1) == 1
    return out


def _resumed_sync_check(name, cfg, device) -> dict:
    """After ro.save_checkpoint / ro.load_checkpoint into a fresh model and optimizer: the step counters are on the
    CPU (a counter on the GPU makes each of its reads a sync) and a step is still sync-free."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batches = _batches(cfg, 4, device)
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    model = shard_model(build_model(cfg, seed=0, device=device), "ours", mp_policy=mp)
    opt = OPTIMIZERS[name](model)
    for b in batches[:2]:
        _step(model, opt, *b)
    ro.save_checkpoint(path, model, [opt])
    model = shard_model(build_model(cfg, seed=1, device=device), "ours", mp_policy=mp)
    opt = OPTIMIZERS[name](model)
    ro.load_checkpoint(path, model, [opt])
    _step(model, opt, *batches[2])  # (a first step of this optimizer object: its one-time checks)
    steps = [st["step"] for st in opt.state.values() if isinstance(st.get("step"), torch.Tensor)]
    set_nonfinite_policy(opt, "off")
    out = {
        "step_counters_on_cpu": all(t.device.type == "cpu" for t in steps),
        **_sync_free_step(model, opt, batches[3]),
    }
    out["ok"] = out["step_counters_on_cpu"] and out["sync_free_step"]
    return out


def _parity(cfg, device) -> dict:
    """Ours and torch FSDP2 (the control: its distance is what sharding on this GPU costs) against one process."""
    models = {
        "ours": shard_model(build_model(cfg, seed=0, device=device), "ours"),
        "fsdp2": shard_model(build_model(cfg, seed=0, device=device), "torch"),
        "plain": build_model(cfg, seed=0, device=device),
    }
    start = {n: p.detach().clone() for n, p in models["plain"].named_parameters()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    for b in _batches(cfg, 4, device):
        for k, m in models.items():
            _step(m, opts[k], *b)
    full = {
        "ours": {n: ro.full_tensor(p) for n, p in models["ours"].named_parameters()},
        "fsdp2": {n: p.full_tensor() for n, p in models["fsdp2"].named_parameters()},
    }
    with torch.no_grad():
        plain = dict(models["plain"].named_parameters())
        diff = {k: max((f[n] - plain[n]).abs().max().item() for n in plain) for k, f in full.items()}
        moved = max((p - start[n]).abs().max().item() for n, p in plain.items())
    return {
        "max_abs_diff_vs_one_process": diff["ours"],
        "fsdp2_max_abs_diff_vs_one_process": diff["fsdp2"],
        "max_param_change": moved,
        "ok": diff["ours"] <= 4 * diff["fsdp2"] + 4 * torch.finfo(torch.float32).eps * moved,
    }


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    cfg = get_config("small")
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    try:
        for name in OPTIMIZERS:
            checks = [(name, _sync_check)] + (
                [(f"{name}_resumed", _resumed_sync_check)] if name != "torch_adamw" else []
            )
            for key, check in checks:
                try:
                    result[key] = check(name, cfg, device)
                except Exception as e:  # report and go on: one optimizer's failure must not hide the others
                    result[key] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        result["parity_adamw"] = _parity(cfg, device)
    finally:
        dist.destroy_process_group()
    result["ok"] = all(v["ok"] for v in result.values() if isinstance(v, dict))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
