"""State dicts of ragged-sharded models speak torch's distributed checkpoint (DCP): ``get_model_state_dict`` /
``get_optimizer_state_dict`` + ``dcp.save`` / ``dcp.load`` + ``set_*_state_dict`` round-trip exactly at any
world-size pair, to and from torch FSDP2 and a plain model (issue 16, point 1). Each test here failed on main
before this change: main's ``state_dict()`` held each rank's flat piece under the param's name, so DCP stored one
rank's piece as the whole tensor (wrong shapes, lost elements, wrong values after a reload) and a failed full
load left a half-loaded model."""

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ragged_optim.comm.launch import free_port, run_on_ranks
from ragged_optim.sharding import fully_shard, get_full_state_dict
from ragged_optim.testing import _set_grads, default_grad

FULL = StateDictOptions(full_state_dict=True)


class IssueNet(nn.Module):
    """The issue's model: Embedding, two Linear/Linear blocks, LayerNorm, a head (sizes drawn by the tests)."""

    def __init__(self, vocab=515, d=48, hidden=136, out=11, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, hidden), nn.Linear(hidden, d)) for _ in range(2)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, out)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def ours(model):
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def fsdp2(model):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for b in model.blocks:
        torch_fully_shard(b)
    torch_fully_shard(model)
    return model


SHARDERS = {"ours": ours, "fsdp2": fsdp2, "plain": lambda m: m}


def full_model(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=FULL).items()}


# ----------------------------------------------------------------------------------------------- model only


def save_model(rank, world, path, dims, kind):
    model = SHARDERS[kind](IssueNet(**dims))
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    full = full_model(model)  # a collective: every rank
    return full if rank == 0 else None


def load_model(rank, world, path, dims, kind):
    model = SHARDERS[kind](IssueNet(**dims, seed=7))  # other values everywhere
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd)
    full = full_model(model)
    return full if rank == 0 else None


def assert_same(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        if not isinstance(want[k], torch.Tensor):  # AdamW8bit's m_bound_sq, a float
            assert got[k] == want[k], k
            continue
        assert got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


dims_st = st.fixed_dictionaries(
    {"vocab": st.integers(3, 70), "d": st.integers(1, 9), "hidden": st.integers(1, 13), "out": st.integers(1, 5)}
)


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(w_save=st.integers(1, 6), w_load=st.integers(1, 6), dims=dims_st)
def test_model_roundtrip_any_world_sizes(tmp_path_factory, w_save, w_load, dims):
    """ours at w_save -> files -> ours at w_load, and the files as torch.save: full shapes and values, exactly."""
    path = str(tmp_path_factory.mktemp("m") / "ckpt")
    want = run_on_ranks(save_model, w_save, path, dims, "ours")[0]
    assert_same(want, IssueNet(**dims).state_dict())  # the full state dict is the model's
    dcp_to_torch_save(path, path + ".pt")
    assert_same(torch.load(path + ".pt"), want)  # names and full shapes in the files, every element
    assert_same(run_on_ranks(load_model, w_load, path, dims, "ours")[0], want)


@pytest.mark.parametrize("src,dst", [("ours", "fsdp2"), ("fsdp2", "ours"), ("ours", "plain"), ("plain", "ours")])
def test_model_moves_between_ours_fsdp2_and_plain(tmp_path, src, dst):
    dims = {"vocab": 515, "d": 48, "hidden": 136, "out": 11}
    path = str(tmp_path / "ckpt")
    w_src, w_dst = (3 if src != "plain" else 1), (2 if dst != "plain" else 1)
    want = run_on_ranks(save_model, w_src, path, dims, src)[0]
    assert_same(run_on_ranks(load_model, w_dst, path, dims, dst)[0], want)


# ----------------------------------------------------------------------------------------------- with AdamW


def make_opt(model, name):
    if name == "muon":  # our optimizer at its defaults: momentum_buffer, and exp_avg/exp_avg_sq of its AdamW half
        from ragged_optim.optim import Muon

        return Muon(model.parameters())
    if name == "adamw8bit":  # 8-bit codes and block scales (a plain model held the codes flat: DCP refused them)
        from ragged_optim.optim import AdamW8bit

        return AdamW8bit(model.parameters(), lr=0.01, min_8bit_size=1)
    if name == "shampoo":  # momentum (the local rows) and band state (keyed by band, on the rank computing it)
        from ragged_optim.optim import Shampoo

        return Shampoo(model.parameters(), lr=0.01, max_preconditioner_dim=16, epsilon=1e-6)
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def train_opt(model, steps, name="adamw"):
    opt = make_opt(model, name)
    for step in range(steps):
        _set_grads(model, step, default_grad)
        opt.step()
        opt.zero_grad()
    return opt


def full_optim(model, opt) -> dict:
    osd = get_optimizer_state_dict(model, opt, options=FULL)
    # Shampoo's "bands" (a dict per band) are left out: a full state dict keeps only rank 0's bands (documented);
    # the continued training below checks that every band was restored
    return {
        f"{fqn}.{k}": v.detach().clone() if isinstance(v, torch.Tensor) else v
        for fqn, st_ in osd["state"].items()
        for k, v in st_.items()
        if not isinstance(v, dict)
    }


def save_trained(rank, world, path, kind, name):
    model = SHARDERS[kind](IssueNet())
    opt = train_opt(model, 2, name)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    out = (full_model(model), full_optim(model, opt))
    return out if rank == 0 else None


def load_trained(rank, world, path, kind, name):
    model = SHARDERS[kind](IssueNet(seed=7))
    opt = make_opt(model, name)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    restored = (full_model(model), full_optim(model, opt))
    # continue: two more steps; the caller compares with a run that never stopped
    for step in range(2, 4):
        _set_grads(model, step, default_grad)
        opt.step()
        opt.zero_grad()
    after = full_model(model)
    return (restored, after) if rank == 0 else None


def uninterrupted(rank, world, name):
    model = IssueNet()
    train_opt(model, 4, name)
    return full_model(model)


@pytest.mark.parametrize(
    "src,w_src,dst,w_dst,name",
    [
        ("ours", 3, "fsdp2", 2, "adamw"),
        ("fsdp2", 2, "ours", 4, "adamw"),
        ("ours", 4, "ours", 3, "adamw"),
        ("ours", 4, "ours", 3, "muon"),
        ("ours", 3, "plain", 1, "muon"),
        ("plain", 1, "ours", 3, "adamw8bit"),
        ("ours", 3, "plain", 1, "adamw8bit"),
        ("fsdp2", 3, "fsdp2", 2, "adamw8bit"),
        ("fsdp2", 3, "fsdp2", 2, "shampoo"),
    ],
)
def test_optimizer_state_moves_with_the_model(tmp_path, src, w_src, dst, w_dst, name):
    """get_state_dict/set_state_dict with torch.optim.AdamW, and with Muon's element-wise state: params and state
    restored bitwise, and training continues exactly like a one-process run that never stopped (every rank sees the
    same grads). Our optimizers on torch FSDP2 params too: their state was each rank's local tensor, which DCP
    took for a replicated one (``Size mismatch between saved torch.Size([824]) and current: torch.Size([960])``,
    at any world size)."""
    path = str(tmp_path / "ckpt")
    want_model, want_optim = run_on_ranks(save_trained, w_src, path, src, name)[0]
    (got_model, got_optim), after = run_on_ranks(load_trained, w_dst, path, dst, name)[0]
    assert_same(got_model, want_model)
    assert_same(got_optim, want_optim)
    assert_same(after, run_on_ranks(uninterrupted, 1, name)[0])


# ----------------------------------------------------------------------------------------------- full loads


def full_load_checks(rank, world):
    model = ours(IssueNet())
    before = full_model(model)
    bad = IssueNet(seed=3).state_dict()
    bad["head.weight"] = torch.zeros(12, 48)  # the last param in the model: every other one would load first
    errors = []
    try:
        set_model_state_dict(model, bad, options=FULL)
    except RuntimeError as e:
        errors.append(str(e))
    unchanged = full_model(model)
    missing = IssueNet(seed=3).state_dict()
    del missing["norm.bias"]
    try:
        model.load_state_dict(missing)
    except RuntimeError as e:
        errors.append(str(e))
    unchanged2 = full_model(model)
    # torch's set_model_state_dict(full_state_dict=True) keeps a param the caller left out (as with FSDP2)
    set_model_state_dict(model, missing, options=FULL)
    partial = full_model(model)
    good = IssueNet(seed=3).state_dict()
    set_model_state_dict(model, dict(good), options=FULL)  # (torch distributes the given dict's values in place)
    return before, unchanged, unchanged2, partial, full_model(model), good, errors


def test_full_state_dict_load_is_all_or_nothing():
    """set_model_state_dict(full_state_dict=True): a wrong shape raises before any param is written (main overwrote 7
    of 13 params first); load_state_dict refuses a missing key before writing; a good one loads exactly."""
    before, unchanged, unchanged2, partial, loaded, good, errors = run_on_ranks(full_load_checks, 3)[0]
    assert_same(unchanged, before)
    assert_same(unchanged2, before)
    assert_same(partial, {**good, "norm.bias": before["norm.bias"]})
    assert_same(loaded, good)
    assert "'head.weight' has shape (12, 48) in the state dict but (11, 48)" in errors[0]
    assert "nothing was loaded" in errors[0]
    assert "missing keys ['norm.bias']" in errors[1]


def _edited(sd):
    """A pretrained state dict for a changed model: two keys gone, two new ones."""
    sd = dict(sd)
    del sd["blocks.0.0.weight"], sd["norm.bias"]
    sd["extra.weight"], sd["blocks.0.9.bias"] = torch.zeros(3), torch.zeros(2)
    return sd


def non_strict_loads(rank, world, kind):
    full = IssueNet(seed=3).state_dict()
    out = {}
    for how in ("load_state_dict", "set_model_state_dict", "own_state_dict"):
        model = SHARDERS[kind](IssueNet())
        before = full_model(model)
        if how == "load_state_dict":
            r = model.load_state_dict(_edited(full), strict=False)
        elif how == "set_model_state_dict":
            r = set_model_state_dict(model, _edited(full), options=StateDictOptions(full_state_dict=True, strict=False))
        else:  # the model's own (sharded) state dict, edited the same way
            r = model.load_state_dict(_edited(SHARDERS[kind](IssueNet(seed=3)).state_dict()), strict=False)
        got = full_model(model)
        out[how] = (sorted(r.missing_keys), sorted(r.unexpected_keys))
        kept = ("blocks.0.0.weight", "norm.bias")
        out[how, "loaded"] = all(torch.equal(got[k], full[k]) for k in full if k not in kept)
        out[how, "missing_kept"] = torch.equal(got["norm.bias"], before["norm.bias"])
    return out


def test_non_strict_loads_return_missing_and_unexpected_keys_as_torch_does():
    """Before: ``strict=False`` was ignored (torch calls load hooks with strict=True): ``RuntimeError: ... nothing was
    loaded: missing keys [...]; unexpected keys [...]``. The plain model is the control."""
    plain = run_on_ranks(non_strict_loads, 1, "plain")[0]
    assert plain["load_state_dict"] == (["blocks.0.0.weight", "norm.bias"], ["blocks.0.9.bias", "extra.weight"])
    for r in run_on_ranks(non_strict_loads, 3, "ours"):
        assert r == plain


def local_pieces_refused(rank, world):
    model = ours(IssueNet())
    pieces = {n: p.to_local().clone() for n, p in model.named_parameters()}  # what an old state_dict() gave
    try:
        model.load_state_dict(pieces)
    except RuntimeError as e:
        return str(e)
    return None


def test_flat_local_pieces_are_refused_with_a_hint():
    msg = run_on_ranks(local_pieces_refused, 2)[0]
    assert msg is not None and "flat rank-local piece" in msg


def ragged_tensor_ops(rank, world):
    model = ours(IssueNet())
    sd = model.state_dict()
    t = sd["emb.weight"]
    out = {
        "type": type(t).__name__,
        "shape": tuple(t.shape),
        "full": torch.equal(t.full_tensor(), IssueNet().emb.weight),
    }
    try:
        t @ t.T  # not element-wise: it would need the whole tensor
    except RuntimeError as e:
        out["op"] = str(e)
    out["aliases"] = t.to_local().data_ptr() == dict(model.named_parameters())["emb.weight"].to_local().data_ptr()
    return out


def test_state_dict_entries_are_full_shape_views_of_the_shard():
    out = run_on_ranks(ragged_tensor_ops, 3)[1]
    assert out["type"] == "RaggedDTensor" and out["shape"] == (515, 48) and out["full"] and out["aliases"]
    assert "full_tensor()" in out["op"]


# ----------------------------------------------------------------------------------------------- a real model


def llama_save(rank, world, path):
    import dcp_torchrun_job

    from ragged_optim.checkpoint import save_checkpoint

    model = dcp_torchrun_job.tiny_llama(seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    save_checkpoint(path, model, [opt])
    full = get_full_state_dict(model)
    return full if rank == 0 else None


def test_llama_checkpoint_loads_into_fsdp2_and_ours_under_torchrun(tmp_path):
    """A tiny LlamaForCausalLM trained a step and saved by ro.save_checkpoint at 3 ranks loads, under torchrun at 2
    ranks, into torch FSDP2 with torch's own dcp.load/set_model_state_dict and into ours with ro.load_checkpoint:
    every tensor equal (main wrote flat 1-D entries that neither could load)."""
    import subprocess
    import sys

    import dcp_torchrun_job

    dcp_torchrun_job.tiny_llama(seed=0)  # import transformers once here, not in each forked rank
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "out.pt")
    want = run_on_ranks(llama_save, 3, path)[0]
    support = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support")
    job = os.path.join(support, "dcp_torchrun_job.py")
    port = str(free_port())  # other test runs share this machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    env = {**os.environ, "PYTHONPATH": support, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*cmd, job, path, out], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out)
    assert_same(got["fsdp2"], want)
    assert_same(got["ours"], want)


# ----------------------------------------------------------------------------------------------- tied weights


def tied_model(seed=0):
    from fsdp_models import make_model

    return make_model(seed=seed, d=5, vocab=31)  # the embedding is tied to the head


def save_tied(rank, world, path):
    from fsdp_models import shard

    model = shard(tied_model(), fully_shard)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    full = full_model(model)
    return full if rank == 0 else None


def load_tied(rank, world, path, sharded):
    from fsdp_models import shard

    model = tied_model(seed=4)
    model = shard(model, fully_shard) if sharded else model
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd)
    tied = model.head.weight is model.emb.weight
    full = full_model(model)
    return (full, tied) if rank == 0 else None


@pytest.mark.parametrize("w_load,sharded", [(3, True), (1, False)])
def test_tied_weights_roundtrip(tmp_path, w_load, sharded):
    path = str(tmp_path / "ckpt")
    want = run_on_ranks(save_tied, 2, path)[0]
    assert torch.equal(want["emb.weight"], want["head.weight"])
    got, tied = run_on_ranks(load_tied, w_load, path, sharded)[0]
    assert tied
    assert_same(got, want)


# ----------------------------------------------------------------------------------------------- band optimizers


def _band_opt(model, name):
    from ragged_optim.optim import SOAP, Shampoo

    return {"shampoo": Shampoo, "soap": SOAP}[name](model.parameters(), lr=0.01, max_preconditioner_dim=32)


def _band_steps(model, opt, steps):
    for step in steps:
        _set_grads(model, step, default_grad)
        opt.step()
        opt.zero_grad()


def _bands_held(opt) -> int:
    return sum(len(s.get("bands", {})) for s in opt.state.values())


def torch_full_path(rank, world, name):
    model = ours(IssueNet())
    opt = _band_opt(model, name)
    _band_steps(model, opt, range(2))
    msd, osd = get_state_dict(model, opt, options=FULL)
    model2 = ours(IssueNet(seed=7))
    opt2 = _band_opt(model2, name)
    try:
        set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd, options=FULL)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_band_state_through_torchs_full_state_dict_is_refused_on_every_rank(name):
    """torch's full optimizer state dict holds the saving rank's bands only (each band lives on one rank). Before:
    Shampoo loaded it and the other ranks went on with fresh preconditioners (a different loss at the next step);
    SOAP refused it with "has band '0', but the param has 1 bands" (the keys had become strings)."""
    for err in run_on_ranks(torch_full_path, 2, name):
        assert err is not None and "string keys" in err and "holds the saving rank's blocks only" in err
        assert "ro.get_full_optimizer_state_dict" in err


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_band_state_through_torchs_full_state_dict_on_a_plain_model(name):
    """One process holds every band, so torch's full path is complete there. Before: SOAP refused the string band
    keys torch's flattening makes."""
    model = IssueNet()
    opt = _band_opt(model, name)
    _band_steps(model, opt, range(2))
    msd, osd = copy.deepcopy(get_state_dict(model, opt, options=FULL))  # (as read back from a file: no aliasing)
    model2 = IssueNet(seed=7)
    opt2 = _band_opt(model2, name)
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd, options=FULL)
    _band_steps(model, opt, range(2, 4))
    _band_steps(model2, opt2, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def full_bands_into_sharded(rank, world, name, full):
    model = ours(IssueNet())
    opt = _band_opt(model, name)
    _band_steps(model, opt, range(1))  # (its own bands; the load replaces them)
    opt.load_state_dict(full)
    mats = [p for g in opt.param_groups for p in g["params"] if opt.block_spec(p, g) is not None]
    held = (_bands_held(opt), sum(len(opt.blocks_computed_here(p)) for p in mats))
    return held, full_model(model)


def save_full_bands(rank, world, name):
    model = ours(IssueNet())
    opt = _band_opt(model, name)
    _band_steps(model, opt, range(2))
    from ragged_optim import get_full_optimizer_state_dict

    return get_full_optimizer_state_dict(model, opt)


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_a_full_band_state_dict_loads_each_band_on_the_rank_that_computes_it(name):
    """ro.get_full_optimizer_state_dict (every band) loaded into a sharded optimizer at another world size: each
    rank keeps the bands it computes. Before: every rank kept every saved band."""
    full = run_on_ranks(save_full_bands, 2, name)[0]
    for (held, computed), _ in run_on_ranks(full_bands_into_sharded, 3, name, full):
        assert held == computed


def fsdp2_reload_own_state(rank, world):
    from ragged_optim.optim import SOAP, AdamW8bit, Muon, Shampoo, muon_param_groups

    makers = {
        "muon": lambda m: Muon(muon_param_groups(m)),
        "adamw8bit": lambda m: AdamW8bit(m.parameters(), block_size=64, min_8bit_size=1),
        "shampoo": lambda m: Shampoo(m.parameters(), max_preconditioner_dim=16),
        "soap": lambda m: SOAP(m.parameters()),
    }
    out = {}
    for name, make in makers.items():
        runs = []
        for reload in (False, True):
            model = fsdp2(IssueNet())
            opt = make(model)
            for step in range(3):
                if step == 2 and reload:  # what a rollback or an in-memory checkpoint does
                    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                _set_grads(model, step, default_grad)
                opt.step()
                opt.zero_grad()
            runs.append(full_model(model))
        out[name] = runs
    return out


def test_our_optimizers_on_fsdp2_params_reload_their_own_state_dict():
    """Before: ``ValueError: Muon.load_state_dict: state 'momentum_buffer' ... has 680 elements but the param has
    1340 here``: the size check compared an FSDP2 param's local state with the param's global size."""
    for r in run_on_ranks(fsdp2_reload_own_state, 2):
        for plain, reloaded in r.values():
            assert_same(reloaded, plain)


def _async_saved(rank, world_size, path, phase):
    """``dcp.async_save`` of torch's ``get_state_dict`` (torchtitan's checkpointing), training going on while it
    writes; the load must give the values at the save, not after the steps taken since."""
    from ragged_optim.optim import Muon, muon_param_groups
    from ragged_optim.sharding import full_tensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    fully_shard(model)
    opt = Muon(muon_param_groups(model), lr=0.02, ns_dtype=torch.float32)
    snapshot = lambda: {n: full_tensor(p).clone() for n, p in model.named_parameters()}  # noqa: E731
    if phase == "save":
        for step in range(2):
            _set_grads(model, step, default_grad)
            opt.step()
        at_save = snapshot()
        msd, osd = get_state_dict(model, opt)
        # its own process group, as torchtitan does: the writer's collectives run in a thread beside the step's
        pg = torch.distributed.new_group(backend="gloo")
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=pg)
        _set_grads(model, 2, default_grad)
        opt.step()  # while the checkpoint is written
        future.result()
        return at_save, None
    if phase == "reference":  # steps 0 and 1, then step 3's grads: what the loaded run does
        for step in (0, 1, 3):
            _set_grads(model, step, default_grad)
            opt.step()
        return None, snapshot()
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    loaded = snapshot()
    _set_grads(model, 3, default_grad)
    opt.step()
    return loaded, snapshot()


def test_async_save_of_torchs_state_dict(tmp_path):
    """Before: ``aten.new_empty.default on a ragged-sharded state-dict tensor`` (then ``cannot pickle ProcessGroup``):
    DCP's async stager copies each tensor and its attributes. Now the staged copy is a snapshot: loaded at another
    world size it holds the values at the save (the saving run took a step while writing), and the next step
    lands where a run that never stopped lands."""
    path = str(tmp_path / "ckpt")
    at_save, _ = run_on_ranks(_async_saved, 2, path, "save")[0]
    loaded, after = run_on_ranks(_async_saved, 3, path, "load")[0]
    _, want = run_on_ranks(_async_saved, 2, path, "reference")[0]
    assert all(torch.equal(loaded[n], at_save[n]) for n in at_save)
    assert all(torch.equal(after[n], want[n]) for n in want)  # the optimizer state came back too


def _full_from_sharded(rank, world, name):
    model = ours(IssueNet())
    opt = _band_opt(model, name)
    _band_steps(model, opt, range(2))
    return copy.deepcopy(get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_torchs_full_band_state_from_a_sharded_run_is_refused_on_a_plain_model(name):
    """torch's full optimizer state dict of a sharded run holds the saving rank's bands only; loaded into a plain
    model, torch's loader filled the other bands from the loading optimizer's own first step, and training went on
    with fresh preconditioners, silently (0.02-0.03 off after 2 steps). Each band now keeps the step it was last
    updated at, and a band whose step is not its param's is refused."""
    msd, osd = run_on_ranks(_full_from_sharded, 2, name)[0]
    model = IssueNet(seed=7)
    opt = _band_opt(model, name)
    with pytest.raises(ValueError, match=r"were last updated at step 1, the param's saved state is at step 2"):
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=FULL)
