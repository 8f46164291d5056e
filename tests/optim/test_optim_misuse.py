"""Misuse of the optimizers' own API gets a clear exception naming the argument and the fix, before anything changes:
another class's state dict, wrong-type hyperparameters, misspelt muon_param_groups overrides (one process, CPU)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ragged_optim.optim import SOAP, AdamW8bit, Muon, Shampoo, muon_param_groups


def _stepped(cls, shape=(4, 6), seed=0, **kw):
    """An optimizer of ``cls`` over one fresh param of ``shape``, after one step."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g).requires_grad_()
    opt = cls([p], **kw)
    p.grad = torch.randn(shape, generator=g)
    opt.step()
    return opt


def _same(a, b) -> bool:
    """Deep equality of two state dicts (tensors by value)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------- 1. load_state_dict of another class

CROSS = [
    (Muon, Shampoo, "max_preconditioner_dim"),
    (AdamW8bit, Muon, "use_muon"),
    (Shampoo, AdamW8bit, "block_size"),
    (Muon, AdamW8bit, "block_size"),
    (Shampoo, Muon, "use_muon"),
    (Shampoo, SOAP, "shampoo_beta"),
    (SOAP, Shampoo, "grafting"),
    (SOAP, AdamW8bit, "block_size"),
]


@pytest.mark.parametrize("src,dst,key", CROSS, ids=lambda x: getattr(x, "__name__", x))
def test_state_dict_of_another_class_is_refused_and_changes_nothing(src, dst, key):
    saved = copy.deepcopy(_stepped(src).state_dict())
    opt = _stepped(dst, seed=1)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"param_groups\[0\] lacks .*'{key}'.*another optimizer class"):
        opt.load_state_dict(saved)
    assert _same(opt.state_dict(), before)
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.ones_like(p)
    opt.step()  # still usable


def test_state_missing_a_key_the_step_reads_is_refused_and_changes_nothing():
    saved = copy.deepcopy(_stepped(Muon).state_dict())
    saved["state"][0] = {"exp_avg": saved["state"][0]["momentum_buffer"]}  # a Muon param with AdamW state
    opt = _stepped(Muon, seed=1)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"state of param_groups\[0\]\['params'\]\[0\].*lacks \['momentum_buffer'\]"):
        opt.load_state_dict(saved)
    assert _same(opt.state_dict(), before)


def test_saved_group_with_a_bad_value_is_refused():
    saved = copy.deepcopy(_stepped(Shampoo).state_dict())
    saved["param_groups"][0]["lr"] = "0.1"
    opt = _stepped(Shampoo, seed=1)
    with pytest.raises(TypeError, match=r"Shampoo.load_state_dict: saved param_groups\[0\]: lr must be a real number"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 1e-2


@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP, AdamW8bit])
def test_own_state_dict_still_loads(cls):
    src = _stepped(cls, shape=(80, 64))  # 8-bit state for AdamW8bit
    opt = _stepped(cls, shape=(80, 64), seed=1)
    opt.load_state_dict(copy.deepcopy(src.state_dict()))
    assert _same(opt.state_dict(), src.state_dict())


# --------------------------------------------------------------------------- 2. hyperparameter types

BAD_TYPES = [
    (Muon, dict(lr="0.1"), r"lr must be a real number .*or a 1-element tensor, got '0.1' of type str"),
    (Muon, dict(lr=None), r"lr must be a real number.*got None of type NoneType"),
    (Muon, dict(lr=True), r"lr must be a real number.*got True of type bool"),
    (Muon, dict(weight_decay="0.1"), r"weight_decay must be a real number.*got '0.1' of type str"),
    (Muon, dict(momentum="0.9"), r"momentum must be a real number.*got '0.9' of type str"),
    (Muon, dict(nesterov="false"), r"nesterov must be True or False, got 'false' of type str"),
    (Muon, dict(adamw_betas=0.9), r"adamw_betas.* must be \(beta1, beta2\), a tuple of 2 real numbers, got 0.9 of"),
    (Muon, dict(adamw_lr="3e-4"), r"AdamW lr \(adamw_lr.*must be a real number"),
    (Muon, dict(ns_coefficients=(3.4, -4.7)), r"ns_coefficients must be \(a, b, c\)"),
    (Shampoo, dict(lr="0.1"), r"lr must be a real number.*got '0.1' of type str"),
    (Shampoo, dict(lr=None), r"lr must be a real number.*got None"),
    (Shampoo, dict(betas=(0.9, 0.99, 0.5)), r"betas must be \(beta1, beta2\).*got \(0.9, 0.99, 0.5\) of type tuple"),
    (Shampoo, dict(weight_decay="0.1"), r"weight_decay must be a real number"),
    (Shampoo, dict(epsilon="1e-12"), r"epsilon must be a real number"),
    (AdamW8bit, dict(lr="0.1"), r"lr must be a real number.*got '0.1' of type str"),
    (AdamW8bit, dict(lr=None), r"lr must be a real number"),
    (AdamW8bit, dict(betas=0.9), r"betas must be \(beta1, beta2\).*got 0.9 of type float"),
    (AdamW8bit, dict(weight_decay="0.1"), r"weight_decay must be a real number"),
]


@pytest.mark.parametrize("cls,kw,match", BAD_TYPES, ids=lambda x: getattr(x, "__name__", None))
def test_wrong_type_hyperparameters_name_the_argument(cls, kw, match):
    with pytest.raises(TypeError, match=match):
        cls([torch.zeros(4, 4, requires_grad=True)], **kw)


def test_a_bool_is_not_a_step_count():
    with pytest.raises(ValueError, match=r"start_preconditioning_step must be an int .*got True"):
        Shampoo([torch.zeros(4, 4, requires_grad=True)], start_preconditioning_step=True)


def test_wrong_types_in_param_groups():
    w = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(TypeError, match=r"use_muon must be True, False or None.*'false'"):
        Muon([{"params": [w], "use_muon": "false"}])
    with pytest.raises(TypeError, match=r"AdamW betas \(adamw_betas, or betas of a use_muon=False group\) must be"):
        Muon([{"params": [w], "use_muon": False, "betas": (0.9,)}])
    with pytest.raises(TypeError, match=r"nesterov must be True or False, got 1 of type int"):
        Muon([{"params": [w], "use_muon": True, "nesterov": 1}])


@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP, AdamW8bit])
def test_failed_add_param_group_of_a_wrong_type_leaves_the_optimizer_unchanged(cls):
    opt = cls([torch.zeros(4, 4, requires_grad=True)])
    with pytest.raises(TypeError, match="lr must be a real number"):
        opt.add_param_group({"params": [torch.zeros(3, 3, requires_grad=True)], "lr": "0.1"})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [Muon, Shampoo, AdamW8bit])
def test_tensor_lr_still_accepted_and_equal_to_float_lr(cls):
    runs = []
    for lr in (0.01, torch.tensor(0.01, dtype=torch.float64)):  # float64: .item() is exactly 0.01
        opt = _stepped(cls, shape=(80, 64), lr=lr)
        runs.append(opt.param_groups[0]["params"][0].detach().clone())
    assert torch.equal(*runs)


# --------------------------------------------------------------------------- 3. muon_param_groups


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 10)


def test_muon_param_groups_rejects_misspelt_overrides():
    with pytest.raises(ValueError, match=r"unknown override\(s\) \['momentun', 'adamw_beta'\].*'momentum' for "):
        muon_param_groups(_Tiny(), momentun=0.5, adamw_beta=(0.8, 0.9))
    for key in ("betas", "use_muon", "params", "adamw_momentum"):  # would be dropped or clobber the group
        with pytest.raises(ValueError, match=rf"unknown override\(s\) \['{key}'\].*accepted: \['lr'"):
            muon_param_groups(_Tiny(), **{key: 0.5})


def test_muon_param_groups_accepts_every_group_key():
    kw = dict(lr=0.01, eps=1e-7, weight_decay=0.1, momentum=0.9, nesterov=False, ns_steps=3)
    kw.update(ns_coefficients=(3.0, -4.0, 2.0), adjust_lr="match_rms_adamw", ns_dtype=torch.float32)
    kw.update(adamw_lr=1e-3, adamw_betas=(0.8, 0.9), adamw_eps=1e-9, adamw_weight_decay=0.2)
    muon, adamw = Muon(muon_param_groups(_Tiny(), **kw)).param_groups
    assert all(muon[k] == v for k, v in kw.items() if not k.startswith("adamw_"))
    assert all(adamw[k.removeprefix("adamw_")] == v for k, v in kw.items() if k.startswith("adamw_"))


def test_muon_param_groups_exclude_takes_one_item_alone():
    model = _Tiny()
    for one in ("hidden", "hidden.weight", model.hidden, model.hidden.weight):
        (only,) = muon_param_groups(model, exclude=one)  # as if [one]: the Muon group is left empty
        assert only["use_muon"] is False and len(only["params"]) == 5


@pytest.mark.parametrize("cls", [Shampoo, SOAP])
def test_saved_state_missing_a_band_is_refused(cls):
    """A state dict with some of a param's bands (one rank's part of a sharded run's) would have restarted the
    others with fresh preconditioners."""
    saved = copy.deepcopy(_stepped(cls, shape=(80, 64), max_preconditioner_dim=32).state_dict())
    del saved["state"][0]["bands"][1]
    opt = _stepped(cls, shape=(80, 64), seed=1, max_preconditioner_dim=32)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"lacks block\(s\) \[1\] of 'bands', which this rank computes.*get_full_"):
        opt.load_state_dict(saved)
    assert _same(opt.state_dict(), before)


def test_nonfinite_policy_on_a_torch_optimizer_is_refused():
    """Before: accepted and ignored (torch's optimizers never read it): a NaN grad went into every param."""
    from ragged_optim import set_nonfinite_policy

    with pytest.raises(TypeError, match=r"AdamW is not a ragged-optim optimizer.*GradScaler"):
        set_nonfinite_policy(torch.optim.AdamW([torch.zeros(2, requires_grad=True)]), "raise")


LAYOUT_CHANGES = [
    (Shampoo, {"max_preconditioner_dim": 4}, "max_preconditioner_dim", 8),
    (SOAP, {"max_preconditioner_dim": 4}, "max_preconditioner_dim", 8),
    (AdamW8bit, {"min_8bit_size": 1, "block_size": 8}, "block_size", 16),
    (AdamW8bit, {"min_8bit_size": 1}, "min_8bit_size", 1000),
]


@pytest.mark.parametrize("cls,kw,key,new", LAYOUT_CHANGES)
def test_a_layout_hyperparameter_changed_mid_run_is_refused(cls, kw, key, new):
    """Before: Shampoo failed deep in the step (``The expanded size of the tensor (6) must match the existing size
    (4)``), SOAP silently kept the old bands, AdamW8bit raised a bare ``KeyError: 'exp_avg'``; and a state dict saved
    with another value loaded, then failed the same ways."""
    p = nn.Parameter(torch.randn(8, 6))
    opt = cls([p], **kw)
    for _ in range(2):
        p.grad = torch.randn(8, 6)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    before = p.detach().clone()
    opt.param_groups[0][key] = new
    with pytest.raises(ValueError, match=f"\\['{key}'\\] changed from"):
        opt.step()
    assert torch.equal(p, before)
    opt.param_groups[0][key] = kw[key]  # set back: steps again
    opt.step()
    q = nn.Parameter(before.clone())
    other = cls([q], **{**kw, key: new})
    with pytest.raises(ValueError, match=f"has {key}="):
        other.load_state_dict(saved)


@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP, AdamW8bit])
@pytest.mark.parametrize("key", ["maximize", "amsgrad"])
def test_torch_flags_that_would_be_ignored_are_refused(cls, key):
    """torch keeps any key of a param group, so ``{"params": [...], "maximize": True}`` was silently ignored: the
    optimizer minimized (AdamW8bit moved p by -lr where torch.optim.AdamW moves it by +lr). The constructor already
    refused the keyword; a group key now is refused too, naming it, and a built optimizer keeps its groups."""
    with pytest.raises(ValueError, match=rf"param group key {key}=True .*would be ignored"):
        cls([{"params": [torch.zeros(4, 4, requires_grad=True)], key: True}])
    opt = cls([torch.zeros(4, 4, requires_grad=True)])
    with pytest.raises(ValueError, match=rf"{key}=True"):
        opt.add_param_group({"params": [torch.zeros(3, 3, requires_grad=True)], key: True})
    assert len(opt.param_groups) == 1
    cls([{"params": [torch.zeros(4, 4, requires_grad=True)], key: False}])  # the default value is harmless


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int8])
def test_integer_wire_dtypes_are_refused(dtype):
    """Muon took any torch.dtype as wire_dtype: matrices gathered to their owner travelled truncated to integers or
    bools, and the updates came back zero, 35-90x too large or pointing elsewhere. map_blocks the same."""
    w = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="Muon: wire_dtype must be None, one of"):
        Muon([w], wire_dtype=dtype)
    opt = Shampoo([w])
    with pytest.raises(ValueError, match="map_blocks: wire_dtype must be"):
        opt.map_blocks(lambda blocks: [b.value for b in blocks], [w], [torch.ones(4, 4)], wire_dtype=dtype)


def test_fp16_adamw_state_with_an_eps_that_rounds_to_zero_warns():
    """Muon's AdamW half and AdamW8bit's small params keep their state in the param's dtype, as torch.optim.AdamW
    does (and match its arithmetic bit for bit): on fp16 params an eps of 1e-8 or 1e-10 (the defaults) is 0, and an
    element with a zero grad steps by 0/0 = NaN, which the non-finite check (it looks at grads) cannot see. Before,
    nothing said so; now the constructor warns, naming the param and the eps to pass."""
    lin = nn.Linear(4, 4).half()
    for make, name in (
        (lambda: Muon(muon_param_groups(lin)), "adamw_eps"),
        (lambda: AdamW8bit(lin.parameters()), "eps"),
    ):
        with pytest.warns(
            UserWarning, match=rf"is torch.float16 and its AdamW eps=1e-(10|08) is 0 in that dtype.*{name} >="
        ):
            make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = Muon(muon_param_groups(lin), adamw_eps=1e-4)  # no warning
    for p in lin.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in lin.parameters())


def _settings_per_rank(rank, world_size, what):
    import ragged_optim as ro

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 4))
    ro.fully_shard(m)
    lr = 0.02 * (rank + 1) if what == "lr" else 0.02
    opt = (Muon if what != "adamw8bit" else AdamW8bit)(
        m.parameters(), lr=lr if what != "adamw8bit" else 0.01 * (rank + 1)
    )
    if what == "policy":
        ro.set_nonfinite_policy(opt, "off" if rank == 0 else "skip")
    m(torch.randn(4, 8)).sum().backward()
    before = [ro.full_tensor(p).clone() for p in m.parameters()]
    try:
        opt.step()
    except RuntimeError as e:
        return str(e), all(torch.equal(ro.full_tensor(p), b) for p, b in zip(m.parameters(), before))
    return None, None


@pytest.mark.parametrize("what", ["lr", "adamw8bit", "policy"])
def test_ranks_with_other_settings_are_refused_at_the_first_step(what):
    """An lr (or ns_steps, betas...) computed per rank was never compared: each rank updated its pieces, or the
    matrices it owns, with its own value, silently (the error text of the block check even promised "the same
    hyperparameters"). Another set_nonfinite_policy per rank made the ranks run other collectives: a hang until
    gloo's timeout. The first step's agreement check now covers both; every rank raises, nothing changes."""
    from ragged_optim.testing import run_on_ranks

    for err, unchanged in run_on_ranks(_settings_per_rank, 2, what, timeout_s=60):
        assert err is not None and "ranks disagree on the optimizer's settings" in err, err
        assert ("set_nonfinite_policy: 'off' on rank 0 but 'skip'" if what == "policy" else "['lr'] = ") in err
        assert unchanged
