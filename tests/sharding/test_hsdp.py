"""HSDP (2-D replicate x shard meshes) and per-unit process groups on 4 gloo ranks equal one process."""

import pytest
import torch
from adamw_runs import max_diff, single_run
from fsdp_models import batch, local_rows, loss_fn, make_model
from noise_bounds import assert_within_reference, magnitude

from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.optim import Muon
from ragged_optim.sharding import full_tensor, fully_shard, get_full_state_dict, load_full_state_dict

LR, EPS = 1e-4, 1e-6


def _run(rank, world_size, layout, steps=3):
    from torch.distributed.device_mesh import init_device_mesh

    model = make_model()
    if layout == "fsdp":
        meshes = {"blocks": None, "root": None}
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        meshes = {"blocks": mesh, "root": mesh}
    else:  # blocks (the "encoder") over 2 ranks per replica, the root over all 4
        meshes = {"blocks": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), "root": None}
    for b in model.layers:
        fully_shard(b, mesh=meshes["blocks"])
    fully_shard(model, mesh=meshes["root"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(steps):
        x, y = batch(step)
        with count_collectives() as stats:
            loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    local = [p.to_local().clone() for p in model.parameters()]
    return {n: full_tensor(p).clone() for n, p in model.named_parameters()}, local, dict(stats.bytes)


def _batching_gap(ref):
    """The gap between two batchings of the one-process run (4 micro-batches vs one batch), measured here: the
    rounding noise of fp32 sums in another order, which is all the sharded runs may differ by."""
    return max_diff(single_run(world_size=4, one_batch=True), ref)


def test_hsdp_equals_fsdp_and_one_process_and_replicas_stay_identical():
    ref = single_run(world_size=4)
    gap, scale = _batching_gap(ref), magnitude(ref)
    fsdp = run_on_ranks(_run, 4, "fsdp")
    hsdp = run_on_ranks(_run, 4, "hsdp")
    assert_within_reference(max_diff(hsdp[0][0], ref), gap, scale, "HSDP 2x2 vs one process")
    assert_within_reference(max_diff(hsdp[0][0], fsdp[0][0]), gap, scale, "HSDP 2x2 vs FSDP over 4")
    # ranks 0 and 2 are replicas of the same shard (mesh [[0, 1], [2, 3]]): bit-identical params
    assert all(torch.equal(a, b) for a, b in zip(hsdp[0][1], hsdp[2][1]))
    # the all-reduce across replicas moves only the local shard: S elements, where the reduce-scatter over the
    # 2-rank shard group takes 2*S
    assert hsdp[0][2]["all_reduce"] * 2 == hsdp[0][2]["reduce_scatter"]
    assert "all_reduce" not in fsdp[0][2]


def test_units_on_different_groups_coexist():
    ref = single_run(world_size=4)
    mixed = run_on_ranks(_run, 4, "mixed")
    assert_within_reference(max_diff(mixed[0][0], ref), _batching_gap(ref), magnitude(ref), "mixed groups")


def _muon_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 8, bias=False))


def _muon_batch(step):
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step))


def _muon_hsdp(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _muon_model()
    fully_shard(model, mesh=mesh)
    opt = Muon(model.parameters(), ns_dtype=torch.float32)
    for step in range(2):
        model(local_rows(_muon_batch(step), rank, world_size)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.to_local().clone() for p in model.parameters()], get_full_state_dict(model)


def _muon_one_process(micro_batches=1):
    """The reference: unsharded fp32 Muon, same hyperparameters, each step on the whole global batch (or on it in
    ``micro_batches`` accumulated pieces: the same sum in another order)."""
    model = _muon_model()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = Muon(model.parameters(), ns_dtype=torch.float32)
    for step in range(2):
        for x in _muon_batch(step).chunk(micro_batches):
            (model(x).square().mean() / micro_batches).backward()
        opt.step()
        opt.zero_grad()
    return init, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_muon_under_hsdp_replicas_identical():
    out = run_on_ranks(_muon_hsdp, 4)
    assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[2][0]))
    assert all(torch.equal(a, b) for a, b in zip(out[1][0], out[3][0]))
    init, ref = _muon_one_process()
    # The gap is fp32 rounding of the grad (per-rank means, then reduced) carried through fp32 Newton-Schulz
    # (measured here: 1.6e-7, ~7 ulp of the weights, 9e-6 of the 1.7e-2 update). Allowed: the gap of the one-process
    # run in the ranks' 4 micro-batches, measured now; a wrong grad or update (or a no-op step, below) moves params
    # by the update itself.
    gap = max_diff(_muon_one_process(micro_batches=4)[1], ref)
    for _, full in out:  # every rank's gathered params
        assert_within_reference(max_diff(full, ref), gap, magnitude(ref), "Muon under HSDP")
    assert max_diff(out[0][1], init) > 1e-3  # measured 1.7e-2: the params moved


def _reload_under(rank, world_size, sd, layout):
    from torch.distributed.device_mesh import init_device_mesh

    model = make_model(seed=7)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if layout == "hsdp" else None
    fully_shard(model, mesh=mesh)
    load_full_state_dict(model, sd)
    return get_full_state_dict(model)


def test_state_dict_saved_under_hsdp_loads_under_fsdp_and_back():
    plain = make_model(seed=3).state_dict()
    hsdp = run_on_ranks(_reload_under, 4, plain, "hsdp")[0]
    fsdp = run_on_ranks(_reload_under, 4, hsdp, "fsdp")[0]
    back = run_on_ranks(_reload_under, 4, fsdp, "hsdp")[0]
    assert max_diff(hsdp, plain) == 0 and max_diff(back, plain) == 0


def _one_replica_all_reduces(rank, world_size, side):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    if side == "ours, no mesh":
        side, mesh = "ours", None
    model = make_model()
    shard_fn = fully_shard if side == "ours" else torch_fully_shard
    for b in model.layers:
        shard_fn(b, mesh=mesh)
    shard_fn(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(2):  # the second step is counted
        x, y = batch(step)
        with count_collectives() as stats:
            loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()
    full = [(p.full_tensor() if side == "fsdp2" else full_tensor(p)).detach().clone() for p in model.parameters()]
    return (stats.calls.get("all_reduce", 0), stats.calls.get("reduce_scatter", 0)), full


def test_one_replica_hsdp_makes_no_all_reduce():
    """A (1, W) mesh has one replica: averaging across replicas is the identity, so no all-reduce reaches the
    backend (each unit made one per step, a NCCL call apiece on a GPU; FSDP2 makes them too, printed as the
    control), and the params equal the same run without a mesh bit for bit."""
    theirs = run_on_ranks(_one_replica_all_reduces, 2, "fsdp2")
    ours = run_on_ranks(_one_replica_all_reduces, 2, "ours")
    plain = run_on_ranks(_one_replica_all_reduces, 2, "ours, no mesh")
    print(f"[one-replica HSDP] (all_reduce, reduce_scatter) per step: ours {ours[0][0]}, FSDP2 {theirs[0][0]}")
    assert all(r[0] == ours[0][0] for r in ours) and ours[0][0][1] > 0
    assert ours[0][0][0] == 0
    assert all(torch.equal(a, b) for a, b in zip(ours[0][1], plain[0][1]))


def _adamw8bit_steps(model, sharded):
    from ragged_optim.optim import AdamW8bit
    from ragged_optim.testing import set_full_grad

    opt = AdamW8bit(model.parameters(), lr=1e-2, block_size=64, min_8bit_size=1)
    for step in range(2):
        g = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        if sharded:
            set_full_grad(model.weight, g)
        else:
            model.weight.grad = g
        opt.step()
        opt.zero_grad()
    return opt


def _adamw8bit_full_state_hsdp(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_optim import get_full_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16, bias=False)  # 8 blocks of 64
    fully_shard(model, mesh=init_device_mesh("cpu", (2, world_size // 2)))
    return get_full_optimizer_state_dict(model, _adamw8bit_steps(model, True))["state"][0]


def test_full_optimizer_state_under_hsdp_is_the_one_process_state():
    """Before: each replica's 8-bit scales were gathered from the whole world and concatenated, so the full state
    held them once per replica (16 scales for 8 blocks) and did not load into the one-process optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16, bias=False)
    want = _adamw8bit_steps(model, False).state_dict()["state"][0]
    got = run_on_ranks(_adamw8bit_full_state_hsdp, 4)[0]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k] for k in want)


def _two_hsdp_jobs(rank, world_size):
    import warnings

    from torch.distributed.device_mesh import DeviceMesh

    from ragged_optim.optim import AdamW8bit, Muon, muon_param_groups

    job = rank // 2  # job A on ranks 0-1, job B on 2-3: each an HSDP mesh of 2 replicas x 1 shard
    # every rank builds both meshes (new_group is a collective of the world)
    meshes = [DeviceMesh("cpu", [[2 * j], [2 * j + 1]], mesh_dim_names=("replicate", "shard")) for j in (0, 1)]
    mesh = meshes[job]
    out = {}
    for name in ("muon", "adamw8bit"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name == "muon":
            opt = Muon(muon_param_groups(model), lr=0.02, adamw_lr=3e-3)
        else:
            opt = AdamW8bit(model.parameters(), lr=3e-3, block_size=64, min_8bit_size=64)
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank % 2))
            if job == 1 and step == 1:
                x[0, 0] = float("nan")  # job B only
            model(x).square().mean().backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.step()
            opt.zero_grad()
        out[name] = opt.__dict__.get("found_nonfinite", 0)
    return job, out


def _fsdp2_hsdp_params(rank, world_size):
    """torch FSDP2's HSDP params (DTensors placed (Replicate(), Shard(0))) with our clip_grad_norm_ and Muon, which
    steps on them as one process does on the full tensors with the same grads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ragged_optim.optim import muon_param_groups
    from ragged_optim.sharding import clip_grad_norm_

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    model, ref = build(), build()
    torch_fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    ours = clip_grad_norm_(model.parameters(), float("inf"))  # max_norm inf: measures, changes nothing
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    for p, q in zip(model.parameters(), ref.parameters()):
        q.grad = p.grad.full_tensor()
    Muon(muon_param_groups(model), lr=0.05).step()
    Muon(muon_param_groups(ref), lr=0.05).step()
    same = all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), ref.parameters()))
    placements = {str(tuple(p.placements)) for p in model.parameters()}
    return ours.item(), theirs.full_tensor().item(), same, placements


@pytest.fixture(scope="module")
def hsdp_world():
    return run_on_ranks(_two_hsdp_jobs, 4), run_on_ranks(_fsdp2_hsdp_params, 4)


def test_two_hsdp_jobs_in_one_world_do_not_share_step_decisions(hsdp_world):
    """Before: the non-finite flag of HSDP params was reduced over the whole world, so job A skipped the step that only
    job B's NaN gradient should skip (and ranks outside the mesh that were busy elsewhere made the step hang)."""
    for job, skipped in hsdp_world[0]:
        assert skipped == ({"muon": 0, "adamw8bit": 0} if job == 0 else {"muon": 1, "adamw8bit": 1}), (job, skipped)


def test_fsdp2_hsdp_params_clip_like_torch_and_muon_steps_on_them(hsdp_world):
    """Before: both raised torch's ``Found the DeviceMesh have 2 dimensions ... mesh_dim needs to be specified``
    (clip_grad_norm_ from its group lookup; Muon at its first step); then Muon refused them (1-D meshes only). Now
    each matrix is computed once on the 2 x 2 mesh and sent to both replicas: bitwise one process's step."""
    for ours, theirs, same, placements in hsdp_world[1]:
        assert ours == theirs  # the largest |grad|: exact on both sides
        assert placements == {"(Replicate(), Shard(dim=0))"}
        assert same
