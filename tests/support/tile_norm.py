"""A user's ``BlockOptimizer`` that keeps state of every kind (``TileNorm``), the two-linear ``Net`` it trains, and
the steps to build, train, snapshot and compare them across ranks (the state-schema and tile tests; not a test
itself)."""

import torch
import torch.distributed as dist
from torch import nn

import ragged_optim as ro
from ragged_optim.testing import _set_grads, default_grad

SAVE_AT, TOTAL = 2, 4
# Import what the optimizers import lazily (torch._dynamo) once here, not in every forked rank.
make_warm = torch.optim.SGD([nn.Parameter(torch.zeros(1))])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 10)  # weight: 3 bands of 4, 4, 2 rows (tiles and peak)
        self.b = nn.Linear(10, 6)  # weight: 2 bands (tiles only: at 3 ranks some rank computes neither)


class TileNorm(ro.BlockOptimizer):
    """Per band of 4 rows: momentum, running mean square and a count in a dict under ``tiles``; the band's peak
    ``|momentum|`` in ``peak`` (one value per band, matrices of 3 bands or more); vectors: SGD with momentum."""

    def __init__(self, params, lr=0.01, peak_kind=None):
        self.peak_kind = peak_kind  # (a test's other declaration of "peak")
        super().__init__(params, dict(lr=lr))

    def block_spec(self, p, group):
        return ro.BlockSpec.rows(4, ro.full_shape(p)) if len(ro.full_shape(p)) == 2 else None

    def state_schema(self, p, group):
        spec = self.block_spec(p, group)
        if spec is None:
            return {"momentum": ro.Elem(), "step": ro.Replicated()}
        return {"tiles": ro.Blocks(spec), "peak": self.peak_kind or ro.Blocks(spec, form="value")}

    @torch.no_grad()
    def step(self, closure=None):  # (torch's get_state_dict passes closure=None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            mats = [p for p in params if self.block_spec(p, group) is not None]
            for p in params:
                if self.block_spec(p, group) is not None:  # its state appears with its bands, where computed
                    continue
                st = self.state[p]
                if "momentum" not in st:
                    st["momentum"], st["step"] = torch.zeros_like(ro.local(p)), torch.tensor(0.0)
                st["step"] += 1
                st["momentum"].mul_(0.9).add_(ro.local(p.grad))
                ro.local(p).add_(st["momentum"], alpha=-group["lr"])
            updates = self.map_blocks(self._band_updates, mats, [ro.local(p.grad) for p in mats])
            for p, u in zip(mats, updates):
                ro.local(p).add_(u, alpha=-group["lr"])

    def _band_updates(self, blocks):
        out = []
        for b in blocks:
            st = self.state[b.param]
            if "peak" not in st and ro.full_shape(b.param)[0] > 8:
                st["peak"] = torch.zeros(len(self.blocks_computed_here(b.param)))
            g = b.value.clone()  # (a fresh tensor: the same bits wherever the band sits)
            zeros = torch.zeros(b.shape)
            tiles = st.setdefault("tiles", {})
            t = tiles.setdefault(b.index, {"m": zeros.clone(), "sq": zeros.clone(), "n": torch.tensor(0.0)})
            t["m"].mul_(0.9).add_(g)
            t["sq"].mul_(0.99).addcmul_(g, g, value=0.01)
            t["n"] += 1
            u = t["m"] / (t["sq"].sqrt() + 1e-8)
            if "peak" in st:
                i = self.blocks_computed_here(b.param).index(b.index)
                st["peak"][i] = torch.maximum(st["peak"][i], t["m"].abs().max())
                u = u / (1.0 + st["peak"][i])
            out.append(u)
        return out


def build(kind, cls=TileNorm, **kw):
    model = Net()
    if kind != "plain":
        if kind == "ours":
            shard = ro.fully_shard
        else:
            from torch.distributed.fsdp import fully_shard as shard
        shard(model.a)
        shard(model.b)
        shard(model)
    return model, cls(model.parameters(), **kw)


def train(model, opt, start, stop):
    for step in range(start, stop):
        _set_grads(model, step, default_grad)
        opt.step()
        opt.zero_grad()


def snapshot(model):
    return {n: ro.full_tensor(p).detach().clone() for n, p in model.named_parameters()}


def canonical(model, opt) -> dict[str, torch.Tensor]:
    """Every state tensor in its one-process form, under 'param/key[/block/field]', assembled here from each rank's
    own state (not by the library's export, one of the paths under test): a collective."""
    names = {id(p): n for n, p in model.named_parameters()}
    mine = []
    for g in opt.param_groups:
        for p in g["params"]:
            lo, hi = ro.local_range(p)
            entry = {}
            for k, v in opt.state.get(p, {}).items():
                if k == "tiles":
                    entry[k] = {f"{b}/{f}": t.clone() for b, fields in v.items() for f, t in fields.items()}
                elif k == "peak":  # one value per block this rank computes, in blocks_computed_here order
                    entry[k] = dict(zip(opt.blocks_computed_here(p), v.clone()))
                elif k == "momentum":
                    entry[k] = (lo, hi, v.reshape(-1).clone())
                else:
                    entry[k] = v.clone()
            mine.append((names[id(p)], tuple(ro.full_shape(p)), entry))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out = {}
    for part in parts:
        for name, shape, entry in part:
            for k, v in entry.items():
                if k in ("tiles", "peak"):  # each block's state on one rank: the one that computes it
                    held = {f"{name}/{k}/{b}": t for b, t in v.items()}
                    assert not set(held) & set(out), f"{sorted(set(held) & set(out))[:3]} held by two ranks"
                    out.update(held)
                elif k == "momentum":
                    lo, hi, piece = v
                    out.setdefault(f"{name}/momentum", torch.zeros(shape)).view(-1)[lo:hi] = piece
                else:
                    out[f"{name}/{k}"] = v
    return out


def assert_bitwise(got: dict, want: dict, what: str):
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(set(got) ^ set(want))[:6]}"
    bad = [k for k in want if got[k].shape != want[k].shape or not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} of {len(want)} differ, e.g. {bad[:4]}"
