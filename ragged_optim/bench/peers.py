"""`bench peers`: our optimizers one-on-one with the ones a user would pick instead, in one process.

The model is the ``small`` GPT of :mod:`ragged_optim.models` (1.24M params). For every seed, each row starts from
the same init and sees the same batches; every step the rows run in a rotated order (row ``s mod n`` first), the
forward and backward are untimed and only ``opt.step()`` is timed. The lr follows a short linear warmup and a
cosine decay to 10% (the same multiplier for every row). After the last step each row's validation loss is the
mean over ``EVAL_BATCHES`` fixed validation batches.

Rows, by optimizer family (the first row of each family is ours; ratios are ours over that row):

- Muon: ``ro.Muon`` (default ``ns_matmul="auto"``), ``ro.Muon`` with ``ns_matmul="native"`` (torch's own bf16
  Newton-Schulz matmuls, bitwise torch.optim.Muon's arithmetic), ``torch.optim.Muon`` + ``torch.optim.AdamW`` on
  the same split (:func:`ragged_optim.optim.muon_param_groups`), Keller Jordan's ``muon-optimizer``
  (``SingleDeviceMuonWithAuxAdam``);
- AdamW8bit: ``ro.AdamW8bit``, fp32 ``torch.optim.AdamW``, bitsandbytes' ``AdamW8bit``, torchao's ``AdamW8bit``;
- Shampoo: ``ro.Shampoo``, fp32 ``torch.optim.AdamW`` (the same run as above), pytorch_optimizer's ``Shampoo``;
- SOAP: ``ro.SOAP``, fp32 ``torch.optim.AdamW`` (the same run), pytorch_optimizer's ``SOAP`` (a port of the
  reference implementation), both at the reference's defaults (betas (0.95, 0.95), weight decay 0.01,
  precondition_frequency 10; every matrix of the model is one band).

Per row: final validation loss per seed, its mean and spread (max - min), the median step time and the ratio ours
/ this row, optimizer state bytes per model param (every tensor the optimizer keeps, tensor subclasses by their
inner tensors), and the largest per-element step ``max |p_t - p_{t-1}| / lr_t`` over all steps and seeds. A peer
that is not installed (``pip install 'ragged-optim[peers]'``) or fails is a row with its reason.

Targets (issue 19): ``soap_val_loss_minus_peer`` within ``soap_peer_seed_spread``, and
``soap_val_loss_ratio_vs_adamw`` < 1 (mean over seeds of the per-seed ratio).

Targets (issue 18): ``adamw8bit_max_step_over_lr`` <= 2, ``adamw8bit_val_loss_ratio_vs_fp32`` <= 1.01 (mean over
seeds of the per-seed ratio), ``muon_step_time_ratio_vs_torch`` <= 1 (ours with ``ns_matmul="native"`` and the
default non-finite check on, over torch.optim.Muon + AdamW).

Every loss ratio key comes with ``_per_seed`` (the ratios) and ``_stderr`` (the standard error of their mean, None
for one seed): the seeds' spread is often larger than the gaps between rows, and the error says how far the mean
can be trusted. ``adamw8bit_bnb_val_loss_ratio_vs_fp32`` is bitsandbytes' ratio by the same definition.
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import time
from typing import Any

import torch

DESCRIPTION = "Muon, AdamW8bit, Shampoo, SOAP vs their peers on the small GPT: loss, step time, state bytes, max step"

PRESET = "small"
DEFAULT_STEPS = 300
DEFAULT_SEEDS = (0, 1, 2)
BATCH_SIZE = 16
EVAL_BATCHES = 4
ADAM_LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.01
MUON_LR, MUON_MOMENTUM = 0.02, 0.95
SHAMPOO_LR = 3e-3
SOAP_LR = 3e-3


def lr_multiplier(step: int, steps: int) -> float:
    """Linear warmup over the first 5% of steps (at least one), then cosine decay from 1 to 0.1."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class _Pair:
    """Two optimizers stepped as one (torch.optim.Muon for the matrices + torch.optim.AdamW for the rest)."""

    def __init__(self, *opts):
        self.opts = opts
        self.param_groups = [g for o in opts for g in o.param_groups]
        self.state = {k: v for o in opts for k, v in o.state.items()}

    def step(self):
        for o in self.opts:
            o.step()
        self.state = {k: v for o in self.opts for k, v in o.state.items()}

    def zero_grad(self, set_to_none: bool = True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def _muon_groups(model):
    from ragged_optim.optim import muon_param_groups

    groups = muon_param_groups(model)
    muon = [g for g in groups if g.get("use_muon", True) and g["params"]]
    adamw = [g for g in groups if not g.get("use_muon", True) and g["params"]]
    return [p for g in muon for p in g["params"]], [p for g in adamw for p in g["params"]]


def _make(row: str, model) -> Any:
    """The optimizer of ``row`` over ``model``'s params (raises ImportError / anything else for a missing peer)."""
    params = list(model.parameters())
    adamw_kw = dict(lr=ADAM_LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    if row in ("ro.Muon", "ro.Muon native NS"):
        from ragged_optim.optim import Muon, muon_param_groups

        return Muon(
            muon_param_groups(model),
            lr=MUON_LR,
            momentum=MUON_MOMENTUM,
            weight_decay=WEIGHT_DECAY,
            adamw_lr=ADAM_LR,
            adamw_betas=BETAS,
            adamw_eps=EPS,
            adamw_weight_decay=WEIGHT_DECAY,
            ns_matmul="native" if row.endswith("native NS") else "auto",
        )
    if row == "torch.optim.Muon+AdamW":
        mats, rest = _muon_groups(model)
        muon = torch.optim.Muon(
            mats, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=True, adjust_lr_fn="original"
        )
        return _Pair(muon, torch.optim.AdamW(rest, **adamw_kw))
    if row == "muon-optimizer (Keller Jordan)":
        from muon import SingleDeviceMuonWithAuxAdam

        mats, rest = _muon_groups(model)
        return SingleDeviceMuonWithAuxAdam(
            [
                dict(params=mats, use_muon=True, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=WEIGHT_DECAY),
                dict(params=rest, use_muon=False, lr=ADAM_LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
            ]
        )
    if row == "ro.AdamW8bit":
        from ragged_optim.optim import AdamW8bit

        return AdamW8bit(params, **adamw_kw)
    if row == "torch.optim.AdamW (fp32)":
        return torch.optim.AdamW(params, **adamw_kw)
    if row == "bitsandbytes AdamW8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **adamw_kw)
    if row == "torchao AdamW8bit":
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit

        return TorchaoAdamW8bit(params, **adamw_kw)
    if row == "ro.Shampoo":
        from ragged_optim.optim import Shampoo

        return Shampoo(params, lr=SHAMPOO_LR, weight_decay=WEIGHT_DECAY)
    if row == "pytorch_optimizer Shampoo":
        from pytorch_optimizer import Shampoo as PeerShampoo

        return PeerShampoo(params, lr=SHAMPOO_LR, momentum=BETAS[0], weight_decay=WEIGHT_DECAY, weight_decouple=True)
    if row == "ro.SOAP":
        from ragged_optim.optim import SOAP

        return SOAP(params, lr=SOAP_LR, weight_decay=WEIGHT_DECAY)
    if row == "pytorch_optimizer SOAP":
        from pytorch_optimizer import SOAP as PeerSOAP

        return PeerSOAP(params, lr=SOAP_LR, weight_decay=WEIGHT_DECAY)
    raise ValueError(f"unknown row {row!r}")


#: family -> rows (ours first).
FAMILIES = {
    "muon": ("ro.Muon", "ro.Muon native NS", "torch.optim.Muon+AdamW", "muon-optimizer (Keller Jordan)"),
    "adamw8bit": ("ro.AdamW8bit", "torch.optim.AdamW (fp32)", "bitsandbytes AdamW8bit", "torchao AdamW8bit"),
    "shampoo": ("ro.Shampoo", "torch.optim.AdamW (fp32)", "pytorch_optimizer Shampoo"),
    "soap": ("ro.SOAP", "torch.optim.AdamW (fp32)", "pytorch_optimizer SOAP"),
}


def _tensor_bytes(t) -> int:
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(opt) -> int:
    """Bytes of every tensor in ``opt.state`` (nested lists/dicts too; tensor subclasses by their inner tensors)."""

    def walk(x) -> int:
        if isinstance(x, torch.Tensor):
            return _tensor_bytes(x)
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, list | tuple):
            return sum(walk(v) for v in x)
        return 0

    return sum(walk(s) for s in opt.state.values())


def _set_lr(opt, base: list, mult: float) -> None:
    for g, lr in zip(opt.param_groups, base):
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr * mult)
        else:
            g["lr"] = lr * mult


def _batch(split: str, i: int, seq_len: int, corpus, device, seed: int = 0):
    from ragged_optim.data import get_batch

    return tuple(t.to(device) for t in get_batch(split, BATCH_SIZE, seq_len, i, seed=seed, corpus=corpus))


def _sync(device) -> None:
    """Wait for queued GPU work, so that a timer around ``opt.step()`` measures the step, not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _val_loss(model, corpus, device) -> float:
    with torch.no_grad():
        losses = [model(*_batch("val", i, model.config.seq_len, corpus, device)).item() for i in range(EVAL_BATCHES)]
    return sum(losses) / len(losses)


def _train_seed(rows: list[str], seed: int, steps: int, corpus, device="cpu") -> dict[str, dict]:
    """One seed: every row from the same init on the same batches, rotated order, timed ``opt.step()``."""
    from ragged_optim.models import build_model

    base_model = build_model(PRESET, seed=seed).to(device)  # built on the CPU: the same init on every device
    live, out = {}, {}
    for row in rows:
        model = copy.deepcopy(base_model)
        try:
            opt = _make(row, model)
        except Exception as e:  # noqa: BLE001 (a peer that is missing or refuses: a row with its reason)
            out[row] = {"status": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            continue
        live[row] = (model, opt, [g["lr"] if not isinstance(g["lr"], torch.Tensor) else g["lr"].item()
                                  for g in opt.param_groups])  # fmt: skip
        out[row] = {"status": "ok", "step_s": [], "max_step_over_lr": 0.0}
    names = list(live)
    for s in range(steps):
        mult = lr_multiplier(s, steps)
        x, y = _batch("train", s, base_model.config.seq_len, corpus, device, seed=seed)
        k = s % max(1, len(names))
        for row in names[k:] + names[:k]:
            if out[row]["status"] != "ok":
                continue
            model, opt, base = live[row]
            _set_lr(opt, base, mult)
            try:
                loss = model(x, y)
                loss.backward()
                params = [p for p in model.parameters() if p.grad is not None]
                before = [p.detach().clone() for p in params]
                _sync(device)
                t0 = time.perf_counter()
                opt.step()
                _sync(device)
                out[row]["step_s"].append(time.perf_counter() - t0)
                opt.zero_grad(set_to_none=True)
                unit = base[0] * mult
                moved = max((p.detach() - b).abs().max().item() for p, b in zip(params, before))
                out[row]["max_step_over_lr"] = max(out[row]["max_step_over_lr"], moved / unit)
                if not math.isfinite(loss.item()):
                    raise FloatingPointError(f"non-finite training loss at step {s}")
            except Exception as e:  # noqa: BLE001 (a peer failing mid-run: keep its reason, go on)
                out[row] = {"status": f"{type(e).__name__} at step {s}: {str(e).splitlines()[0] if str(e) else ''}"}
    for row in names:
        if out[row]["status"] == "ok":
            model, opt, _ = live[row]
            out[row]["val_loss"] = _val_loss(model, corpus, device)
            out[row]["state_bytes_per_param"] = state_bytes(opt) / sum(p.numel() for p in model.parameters())
    return out


def rows_of(families=None) -> tuple[list[str], list[str]]:
    """``(family names, rows to train)`` for names of :data:`FAMILIES` (None: all); a row in two families is
    trained once."""
    unknown = [f for f in families or () if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    names = list(FAMILIES) if families is None else list(families)
    return names, list(dict.fromkeys(r for f in names for r in FAMILIES[f]))  # (fp32 AdamW is in two)


def run(
    world_size: int | None = None,
    steps: int | None = None,
    *,
    seeds=DEFAULT_SEEDS,
    families=None,
    device: str = "cpu",
) -> dict:
    """Train every row for ``steps`` steps (default 300) on each seed; one process (``world_size`` is ignored:
    the CLI passes it to every benchmark). ``seeds``: the seeds, or their number N (seeds 0 .. N-1).
    ``families``: names of :data:`FAMILIES` (default all). ``device="cuda"``: the same runs on one GPU (the init is
    still drawn on the CPU; each timed step is bracketed by ``torch.cuda.synchronize``)."""
    from ragged_optim.data import load_corpus

    steps = DEFAULT_STEPS if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    seeds = tuple(range(seeds)) if isinstance(seeds, int) else tuple(seeds)
    if not seeds:
        raise ValueError("seeds must name at least one seed (or be a count >= 1)")
    families, rows = rows_of(families)
    corpus = load_corpus()
    torch.set_num_threads(1)
    per_seed = {}
    for seed in seeds:
        t0 = time.perf_counter()
        per_seed[seed] = _train_seed(rows, seed, steps, corpus, device)
        print(f"[bench peers] seed {seed}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return summarize(per_seed, families, steps, device)


def summarize(per_seed: dict[int, dict[str, dict]], families, steps: int, device: str = "cpu") -> dict:
    """The result of :func:`run` from its per-seed runs (``{seed: _train_seed(...)}``): seeds trained in separate
    processes, merged, give the same keys as one process that trained them all."""
    seeds = tuple(per_seed)
    families = {f: FAMILIES[f] for f in families}
    tables: dict[str, dict[str, dict]] = {}
    for fam, fam_rows in families.items():
        ours = fam_rows[0]
        table = tables[fam] = {}
        for row in fam_rows:
            runs = [per_seed[s][row] for s in seeds]
            bad = [r["status"] for r in runs if r["status"] != "ok"]
            if bad:
                table[row] = {"status": bad[0]}
                continue
            vals = [r["val_loss"] for r in runs]
            times = [t for r in runs for t in r["step_s"]]
            entry = {
                "status": "ok",
                "val_loss_per_seed": vals,
                "val_loss_mean": statistics.fmean(vals),
                "val_loss_spread": max(vals) - min(vals),
                "step_s_median": statistics.median(times),
                "state_bytes_per_param": runs[0]["state_bytes_per_param"],
                "max_step_over_lr": max(r["max_step_over_lr"] for r in runs),
            }
            table[row] = entry
        if table.get(ours, {}).get("status") == "ok":
            for row in fam_rows:
                if table[row].get("status") == "ok":
                    table[row]["step_time_ratio_ours_over_this"] = (
                        table[ours]["step_s_median"] / table[row]["step_s_median"]
                    )
    out: dict[str, Any] = {
        "model": PRESET,
        "steps": steps,
        "seeds": list(seeds),
        "batch_size": BATCH_SIZE,
        "threads": 1,
        "device": device if torch.device(device).type == "cpu" else torch.cuda.get_device_name(device),
        "harness": "one process; same init and batches per seed; order rotated every step; only opt.step() timed",
        "families": tables,
    }
    table = {row: r for fam in ("soap", "shampoo", "adamw8bit", "muon") for row, r in tables.get(fam, {}).items()}

    def ok(row):
        return table.get(row, {}).get("status") == "ok"

    def put_ratio(key, row, reference="torch.optim.AdamW (fp32)"):
        if ok(row) and ok(reference):
            ratios = [a / b for a, b in zip(table[row]["val_loss_per_seed"], table[reference]["val_loss_per_seed"])]
            out[key] = statistics.fmean(ratios)
            out[f"{key}_per_seed"] = ratios
            out[f"{key}_stderr"] = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else None

    if ok("ro.AdamW8bit"):
        out["adamw8bit_max_step_over_lr"] = table["ro.AdamW8bit"]["max_step_over_lr"]
        put_ratio("adamw8bit_val_loss_ratio_vs_fp32", "ro.AdamW8bit")
        put_ratio("adamw8bit_bnb_val_loss_ratio_vs_fp32", "bitsandbytes AdamW8bit")
        if ok("bitsandbytes AdamW8bit"):
            bnb = table["bitsandbytes AdamW8bit"]
            out["adamw8bit_val_loss_minus_bnb"] = table["ro.AdamW8bit"]["val_loss_mean"] - bnb["val_loss_mean"]
            out["adamw8bit_bnb_seed_spread"] = bnb["val_loss_spread"]
    if ok("ro.SOAP"):
        soap = table["ro.SOAP"]
        put_ratio("soap_val_loss_ratio_vs_adamw", "ro.SOAP")
        if ok("pytorch_optimizer SOAP"):
            peer = table["pytorch_optimizer SOAP"]
            out["soap_val_loss_minus_peer"] = soap["val_loss_mean"] - peer["val_loss_mean"]
            out["soap_peer_seed_spread"] = peer["val_loss_spread"]
    if ok("torch.optim.Muon+AdamW"):
        torch_s = table["torch.optim.Muon+AdamW"]["step_s_median"]
        if ok("ro.Muon native NS"):
            out["muon_step_time_ratio_vs_torch"] = table["ro.Muon native NS"]["step_s_median"] / torch_s
            # The same steps paired (both rows ran step s of seed k back to back): machine-load drift cancels.
            out["muon_step_time_ratio_vs_torch_paired_median"] = statistics.median(
                a / b
                for k in seeds
                for a, b in zip(
                    per_seed[k]["ro.Muon native NS"]["step_s"], per_seed[k]["torch.optim.Muon+AdamW"]["step_s"]
                )
            )
        if ok("ro.Muon"):
            out["muon_default_step_time_ratio_vs_torch"] = table["ro.Muon"]["step_s_median"] / torch_s
    return out


def markdown_table(result: dict) -> str:
    """The rows as a Markdown table (README and docs/benchmarks.md)."""
    lines = [
        "| optimizer | final val loss (mean ± spread) | step time ours / this | state bytes / param | max step / lr |",
        "|---|---|---|---|---|",
    ]
    for fam, rows in result["families"].items():
        for row, r in rows.items():
            if r.get("status") != "ok":
                lines.append(f"| {fam}: {row} | not run: {r['status']} | | | |")
                continue
            ratio = r.get("step_time_ratio_ours_over_this")
            lines.append(
                f"| {fam}: {row} | {r['val_loss_mean']:.4f} ± {r['val_loss_spread']:.4f} | "
                f"{'' if ratio is None else f'{ratio:.2f}'} | {r['state_bytes_per_param']:.2f} | "
                f"{r['max_step_over_lr']:.2f} |"
            )
    return "\n".join(lines)
