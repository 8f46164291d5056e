"""A declared state schema (issue 34, items 1, 4, 5): every save and load path reads what each state entry is.

A user's ``BlockOptimizer`` keeps state of every kind: per band of a matrix a dict under the key ``"tiles"`` (not
``"bands"``, the one key main understood), one value per band (``"peak"``, a tensor) for the larger matrix, and an
element-wise momentum with a step counter for vectors. It is trained at 3 ranks, saved through each path
(``ro.save_checkpoint``, torch's ``get_state_dict`` + ``dcp.save``, ``ro.get_full_optimizer_state_dict``), and
loaded at 2 ranks and into a plain model: every state tensor and the params after two more steps must equal the
one-process run that never stopped, bit for bit, on ragged and FSDP2 params, and from a plain model onto both.

On main: the tiles went into ``ro.save_checkpoint`` as one opaque nested entry and came back as garbage keys
(training went on with fresh tiles, no error); torch's path refused the smaller matrix ("Missing optimizer state
for parameter 'b.weight'": the rank that computes none of its bands had no entry); ``save_checkpoint`` refused
FSDP2 params; the consolidated export held the exporting rank's tiles only. Plus: state the schema does not cover
or disagrees with is refused at save, a checkpoint whose schema differs from the optimizer's at load; weights-only
loads; the leftovers of killed saves and ``ro.latest_checkpoint``.
"""

import glob
import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tile_norm import SAVE_AT, TOTAL, Net, TileNorm, assert_bitwise, build, canonical, snapshot, train
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

import ragged_optim as ro
from ragged_optim.comm.launch import RankFailure, run_on_ranks


def reference(_rank, _world):
    model, opt = build("plain")
    train(model, opt, 0, SAVE_AT)
    state = canonical(model, opt)
    train(model, opt, SAVE_AT, TOTAL)
    return state, snapshot(model)


@pytest.fixture(scope="module")
def ref():
    return run_on_ranks(reference, 1)[0]


def save_all(rank, world, root, kind):
    """Train to SAVE_AT and save through every path; returns the state then, the full state dicts, and whether a
    rank computes no band of b.weight (the case torch's path refused)."""
    model, opt = build(kind)
    train(model, opt, 0, SAVE_AT)
    state = canonical(model, opt)
    ro.save_checkpoint(os.path.join(root, "ro"), model, [opt], extra={"step": SAVE_AT})
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "dcp"))
    full = (ro.get_full_state_dict(model), ro.get_full_optimizer_state_dict(model, opt))
    idle = [None] * world
    dist.all_gather_object(idle, not opt.blocks_computed_here(model.b.weight))
    return (state, full, any(idle)) if rank == 0 else None


def load_all(rank, world, root, kind, full):
    """Load through every path into fresh optimizers, read the state before any step, train on to TOTAL."""
    out = {}
    for how in ("ro", "dcp", "full"):
        model, opt = build(kind)
        if how == "ro":
            assert ro.load_checkpoint(os.path.join(root, "ro"), model, [opt]) == {"step": SAVE_AT}
        elif how == "dcp":
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=os.path.join(root, "dcp"))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            set_model_state_dict(model, full[0], options=StateDictOptions(full_state_dict=True))
            opt.load_state_dict(full[1])
        state = canonical(model, opt)
        train(model, opt, SAVE_AT, TOTAL)
        out[how] = (state, snapshot(model))
    return out if rank == 0 else None


def check_loads(ref, root, full, targets, source):
    want_state, want_params = ref
    for target, world in targets:
        for how, (state, params) in run_on_ranks(load_all, world, root, target, full)[0].items():
            what = f"{source} -> {target} at {world} rank(s) via {how}"
            assert_bitwise(state, want_state, f"{what}: the state right after the load")
            assert_bitwise(params, want_params, f"{what}: the params {TOTAL - SAVE_AT} steps later")


@pytest.mark.parametrize("kind", ["ours", "fsdp2"])
def test_custom_state_reshards_through_every_path(tmp_path, ref, kind):
    """Saved at 3 ranks (ragged or FSDP2 params), loaded at 2 ranks and into a plain model."""
    root = str(tmp_path)
    state, full, idle = run_on_ranks(save_all, 3, root, kind)[0]
    assert {"a.weight/tiles/2/m", "a.weight/peak/2", "b.weight/tiles/1/n", "a.bias/momentum"} <= set(state)
    if kind == "ours":
        assert idle  # a rank holds no band of b.weight: only its "tiles" entry (empty) keeps torch's loader going
    assert_bitwise(state, ref[0], f"the {kind} run at 3 ranks vs one process")
    check_loads(ref, root, full, [(kind, 2), ("plain", 1)], f"{kind} at 3 ranks")


def test_plain_state_reshards_onto_sharded_params(tmp_path, ref):
    root = str(tmp_path)
    state, full, _ = run_on_ranks(save_all, 1, root, "plain")[0]
    assert_bitwise(state, ref[0], "the plain run")
    check_loads(ref, root, full, [("ours", 3), ("fsdp2", 2)], "plain")


def torch_adamw_on_fsdp2(rank, world, path, phase):
    """torch's AdamW on FSDP2 params through ro.save_checkpoint / ro.load_checkpoint (before: refused at save)."""
    model, _ = build("fsdp2" if world > 1 or phase != "reference" else "plain")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if phase == "load":
        start = ro.load_checkpoint(path, model, [opt])["step"]
    else:
        start = 0
        train(model, opt, 0, SAVE_AT)
        if phase == "save":
            ro.save_checkpoint(path, model, [opt], extra={"step": SAVE_AT})
            return None
    train(model, opt, start if phase == "load" else SAVE_AT, TOTAL)
    return snapshot(model)


def test_torch_optimizer_on_fsdp2_params_through_save_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    want = run_on_ranks(torch_adamw_on_fsdp2, 1, path, "reference")[0]
    run_on_ranks(torch_adamw_on_fsdp2, 3, path, "save")
    assert_bitwise(run_on_ranks(torch_adamw_on_fsdp2, 2, path, "load")[0], want, "torch AdamW on FSDP2, 3 -> 2 ranks")


# ----------------------------------------------------------------------------------------------- bad input


class Undeclared(TileNorm):
    """Keeps its tiles under a key its schema leaves out."""

    def state_schema(self, p, group):
        return {k: v for k, v in super().state_schema(p, group).items() if k != "tiles"}


def save_undeclared(rank, world, path):
    model, opt = build("ours", cls=Undeclared)
    train(model, opt, 0, 1)
    out = {}
    try:
        ro.save_checkpoint(path, model, [opt])
    except ro.CheckpointError as e:
        out["save_checkpoint"] = str(e)
    try:
        opt.state_dict()
    except ValueError as e:
        out["state_dict"] = str(e)
    return out


def test_state_under_an_undeclared_key_is_refused_at_save(tmp_path):
    """Before: saved as one opaque object, loaded whole on every rank (fresh tiles after a reshard, no error)."""
    path = str(tmp_path / "ckpt")
    out = run_on_ranks(save_undeclared, 2, path)
    for r in out:  # every rank raises, whichever holds tiles
        err = r.get("save_checkpoint", "")
        assert "'tiles'" in err and "Undeclared.state_schema does not declare" in err, err
        assert "ro.Blocks(self.block_spec(p, group))" in err and "nothing was written" in err
    assert any("'tiles'" in r.get("state_dict", "") for r in out)
    assert os.listdir(tmp_path) == []
    model, opt = build("plain", cls=Undeclared)
    train(model, opt, 0, 1)
    with pytest.raises(ValueError, match=r"state 'tiles' of param_groups\[0\]\['params'\]\[0\] with shape \(10, 12\)"):
        opt.state_dict()


def test_a_schema_that_disagrees_with_the_state_is_refused_at_save(tmp_path):
    model, opt = build("plain", peak_kind=ro.Elem())  # "peak" holds one value per band, not per element
    train(model, opt, 0, 1)
    with pytest.raises(ValueError, match=r"'peak' of .*\(10, 12\) is declared Elem\(\) .*120.* holds 3 elements"):
        opt.state_dict()
    with pytest.raises(ro.CheckpointError, match=r"'peak'.*declared Elem\(\).*Fix TileNorm.state_schema"):
        ro.save_checkpoint(str(tmp_path / "ckpt"), model, [opt])
    assert not os.path.exists(tmp_path / "ckpt")
    model, opt = build("plain", peak_kind="elementwise")
    with pytest.raises(TypeError, match=r"state_schema\(\.\.\.\)\['peak'\].*ro.Elem\(\)"):
        train(model, opt, 0, 1)  # (before the step changes anything)
    assert not opt.state and torch.equal(model.a.weight, Net().a.weight)


def test_a_checkpoint_of_another_schema_is_refused_and_nothing_loads(tmp_path):
    path = str(tmp_path / "ckpt")
    model, opt = build("plain")
    train(model, opt, 0, SAVE_AT)
    ro.save_checkpoint(path, model, [opt])
    fresh, other = build("plain", peak_kind=ro.Elem())
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    with pytest.raises(ro.CheckpointError, match=r"'peak' of 'a.weight' was saved as Blocks\(.*form='value'\), but "
                       r"TileNorm.state_schema declares it Elem\(\).*nothing was loaded"):  # fmt: skip
        ro.load_checkpoint(path, fresh, [other])
    assert not other.state and all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())


def test_weights_only_load(tmp_path):
    """Before: ``CheckpointError: ... holds 1 optimizers, 0 were given``."""
    with_opt, without = str(tmp_path / "with"), str(tmp_path / "without")
    model, opt = build("plain")
    train(model, opt, 0, 1)
    ro.save_checkpoint(with_opt, model, [opt])
    ro.save_checkpoint(without, model)
    fresh, fresh_opt = build("plain")
    torch.nn.init.zeros_(fresh.a.weight)
    ro.load_checkpoint(with_opt, fresh)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters())) and not fresh_opt.state
    with pytest.raises(ro.CheckpointError, match=r"holds 0 optimizers, 1 were given"):
        ro.load_checkpoint(without, fresh, [fresh_opt])


def test_exports():
    from ragged_optim.checkpoint import CheckpointError, is_complete, latest_checkpoint

    assert (ro.CheckpointError, ro.is_complete, ro.latest_checkpoint) == (
        CheckpointError,
        is_complete,
        latest_checkpoint,
    )
    assert all(hasattr(ro, n) for n in ("Elem", "Blocks", "Replicated"))


# ----------------------------------------------------------------------------------------------- killed saves


def _kill_in(cls, method):
    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(cls, method, die)


def killed_run(rank, world, root, phase):
    """'write': save step 1, then die (every rank, SIGKILL) while writing step 2. 'publish': resume from the newest
    checkpoint, save step 3 and die (rank 0) after it is complete, before its folder takes its name. 'resume':
    resume from the newest, train to the end, save step 4."""
    model, opt = build("ours")
    start = 0
    if phase != "write":
        newest = ro.latest_checkpoint(root)
        start = ro.load_checkpoint(newest, model, [opt])["step"]
    else:
        train(model, opt, 0, 1)
        ro.save_checkpoint(os.path.join(root, "step_1"), model, [opt], extra={"step": 1})
        start = 1
    stop = {"write": 2, "publish": 3, "resume": TOTAL}[phase]
    train(model, opt, start, stop)
    if phase == "write":
        _kill_in(dcp.FileSystemWriter, "write_data")
    elif phase == "publish" and rank == 0:
        import ragged_optim.checkpoint as ckpt

        ckpt._publish = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    ro.save_checkpoint(os.path.join(root, f"step_{stop}"), model, [opt], extra={"step": stop})
    return (os.path.basename(newest) if phase != "write" else None), snapshot(model)


def test_killed_saves_latest_checkpoint_and_resume(tmp_path, ref):
    """Before: a killed save's ``step_N.tmp-*`` folders stayed for good (a complete one, a full copy, too), and
    there was no way to find the newest complete checkpoint."""
    root = str(tmp_path)
    with pytest.raises(RankFailure):
        run_on_ranks(killed_run, 3, root, "write", timeout_s=60)
    assert sorted(glob.glob(os.path.join(root, "*"))) == [os.path.join(root, "step_1")] + glob.glob(
        os.path.join(root, "step_2.tmp-*")
    )
    assert ro.latest_checkpoint(root) == os.path.join(root, "step_1")
    with pytest.raises(RankFailure):
        run_on_ranks(killed_run, 2, root, "publish", timeout_s=60)
    (complete,) = glob.glob(os.path.join(root, "step_3.tmp-*"))
    assert ro.is_complete(complete) and ro.latest_checkpoint(root) == complete
    newest, params = run_on_ranks(killed_run, 2, root, "resume")[0]
    assert newest == os.path.basename(complete)
    assert_bitwise(params, ref[1], "resumed from the newest checkpoint")
    # the unfinished step_2 folder is gone; the complete step_3 copy took its name
    assert sorted(os.listdir(root)) == ["step_1", "step_3", "step_4"]
    assert ro.latest_checkpoint(root) == os.path.join(root, "step_4")
    assert ro.latest_checkpoint(os.path.join(root, "nothing")) is None
